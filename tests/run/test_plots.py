"""The reward curve (ddpo_group/run/reporting/plots.py): its std band stays within each epoch's rewards, its legend off the
data."""

from __future__ import annotations

from ddpo_group.run.reporting.plots import reward_curve_figure, std_band

# a reward in [0, 1]: epoch 0 has a std that reaches past both ends; epoch 1 lies inside its range
METRICS = [
    {"epoch": 0, "reward_mean": 0.8, "reward_std": 0.35, "reward_min": 0.1, "reward_max": 0.99, "reward_info/a": 0.5},
    {"epoch": 1, "reward_mean": 0.5, "reward_std": 0.125, "reward_min": 0.25, "reward_max": 0.875},
    {"epoch": 2, "reward_mean": 0.25, "reward_std": 0.5},  # written before min / max were logged: not clipped
]


def test_the_band_is_clipped_to_the_epochs_min_and_max():
    lower, upper = std_band(METRICS)
    # exact in binary floating point: 0.8 - 0.35 = 0.45000000000000007 (one rounding), all the others are dyadic
    assert lower == [0.8 - 0.35, 0.375, -0.25] and upper == [0.99, 0.625, 0.75]


def test_the_legend_lies_outside_the_axes():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = reward_curve_figure(METRICS, "t")
    FigureCanvasAgg(figure).draw()  # lays it out as savefig does
    (axes,) = figure.axes
    legend, box = axes.get_legend().get_window_extent(), axes.get_window_extent()
    assert legend.x0 >= box.x1  # right of the data area
    assert legend.x1 <= figure.bbox.x1 and legend.y0 >= figure.bbox.y0  # and inside the picture
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["reward (mean)",
                                                                      "± 1 std, within the\nepoch's min..max", "a"]


def test_the_supervised_epochs_are_shaded_and_left_out_of_the_reward_line():
    """sft.epochs: the epochs without a reward (fine-tuned on sft.data_dir's images) are one shaded span from their
    first to their last, and the reward line starts after them."""
    supervised = [{"epoch": 0, "sft/policy_loss": 0.2}, {"epoch": 1, "sft/policy_loss": 0.1}]
    later = [{**m, "epoch": m["epoch"] + 2} for m in METRICS]
    (axes,) = reward_curve_figure(supervised + later, "t").axes
    labels = [t.get_text() for t in axes.get_legend().get_texts()]
    assert labels[0] == "supervised epochs\n(sft.data_dir)" and labels[1] == "reward (mean)"
    (span,) = axes.patches  # x from -0.5 to 1.5 (in data coordinates)
    assert span.get_x() == -0.5 and span.get_x() + span.get_width() == 1.5
    assert list(axes.lines[0].get_xdata()) == [2, 3, 4]
