"""The KL term to a reference model: the reference's weights (model.py) and the one object that owns the
reference forward, the KL kind, the coefficient's controller and where the KL goes (regularizer.py)."""
