"""Example reward servers for heavy judges that run in their own environment, spoken to with ``reward_fn=http``.

* :mod:`.vlm_judge`: a vision-language model behind an OpenAI-compatible endpoint (vLLM, SGLang,
  a hosted API) scores each image against its prompt, from the number it answers or from P(yes);
* :mod:`.geneval`: GenEval's object-detector checks (Mask2Former via mmdet, CLIP colour
  classification) on the prompt's GenEval metadata.

Each builds a reward function ``fn(images, prompts, metadata) -> (rewards, info)`` and serves it
with :func:`ddpo_group.rewards.http_server.make_server`, so the trainer's HTTP client
(:mod:`ddpo_group.rewards.http_client`, whose docstring has the protocol) talks to it unchanged. Their command
lines serve through :func:`ddpo_group.rewards.http_server.serve`: with ``DDPO_REWARD_TOKEN`` set, only requests
carrying that token are answered.
"""
