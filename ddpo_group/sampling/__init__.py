"""Sampling with log-probabilities: every family's stochastic step as a Gaussian policy, and trajectories.

One index convention for a trajectory, everywhere in the package (ALGORITHMS.md's):

    x_n, n = 0 .. T      the latents of a trajectory of T denoising steps: x_0 is the initial noise, x_T the final
                         latent (decoded into the image); step n maps x_n to x_{n+1}
    t_n                  the scheduler's timestep (or flow sigma s_n) at which step n evaluates the denoiser
    l_n, mu_n, sigma_n   the log-probability, mean and std of step n's Gaussian x_{n+1} ~ N(mu_n, sigma_n^2 I)
    clean_hat(x_n)       the clean latent the denoiser predicts at x_n (``clean_hat``): a prediction, never a
                         trajectory state (the hat says so); x_clean in a forward process (the matching objectives)
                         is a clean latent the process noises (there, a rollout's final latent x_T)

Per-step tensors are [B, T] (``log_probs``, ``timesteps``, values V(x_n)); the latents are [B, T+1, ...], a batch
record's ``latents`` / ``next_latents`` [B, T, ...] are x_n / x_{n+1} of each step, and a step's output holds
``next_latents`` too. The schedulers of diffusers count their timesteps down and call x_{n+1} the "previous sample"
(``prev_sample``) of x_n: here it is ``next_latents`` everywhere.
"""
