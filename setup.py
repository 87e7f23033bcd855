from setuptools import find_packages, setup

setup(
    name="ddpo_group",
    version="0.1.0",
    description="Reinforcement-learning fine-tuning of diffusion models: DDPO, the GRPO family, PPO/GAE and GROUP_PPO",
    packages=find_packages(include=["ddpo_group", "ddpo_group.*"]),
    include_package_data=True,
    package_data={"ddpo_group": ["models/tiny_shapes/*", "models/tiny_shapes/*/*", "models/tiny_shapes_classifier/*", "assets/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1,<3",
        "diffusers>=0.30",
        "transformers>=4.40",
        "accelerate>=0.30",
        "peft>=0.12",
        "ml-collections>=0.1.1",
        "wandb>=0.16",
        "safetensors>=0.4",
        "pillow",
        "numpy",
        "tqdm",
        "absl-py",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "msgpack>=1.0"],
        "msgpack": ["msgpack>=1.0"],  # format="msgpack" of the HTTP reward client
    },
)
