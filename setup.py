from setuptools import find_namespace_packages, setup

OCR = ['rapidocr-onnxruntime>=1.4.4,<1.5; python_version < "3.13"', "rapidfuzz>=3"]
HPS = ["open_clip_torch>=2.24"]
JUDGE = ["openai>=1"]  # the VLM judges' client for OpenAI-compatible endpoints (vLLM, SGLang, a hosted API)
# what some model families need beyond the base install: torchvision for transformers' Qwen3-VL processor (Qwen-Image
# 2.1), which is refused without it (install the torchvision built for your torch)
MODELS = ["torchvision"]

setup(
    name="ddpo_group",
    version="0.1.0",
    description="Reinforcement-learning fine-tuning of diffusion models: DDPO, the GRPO family, PPO/GAE and GROUP_PPO",
    # the embedded models' folders and assets/ hold data only: packages without an __init__.py (namespace packages)
    packages=find_namespace_packages(include=["ddpo_group", "ddpo_group.*"], exclude=["*.__pycache__"]),
    package_dir={"": "."},  # an editable install puts the checkout on the path (a .pth file, no import hook)
    package_data={"": ["*.json", "*.jsonl", "*.safetensors", "*.txt"]},
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
        # WanImageToVideoPipeline cleans every prompt with ftfy, which diffusers imports only when it is installed
        "ftfy>=6",
    ],
    extras_require={
        # the OCR reward's engine is small and CPU-only: its tests run with the others (its wheel stops at 3.12)
        # wandb's own reader of an offline run's log (wandb leet inspect): tests/run/test_wandb_offline.py
        "test": ["pytest>=7", "pytest-xdist>=3.2", "hypothesis>=6", "msgpack>=1.0", "wandb>=0.31", *OCR, *JUDGE],
        "msgpack": ["msgpack>=1.0"],  # format="msgpack" of the HTTP reward client
        "ocr": OCR,  # reward_fn=ocr: RapidOCR with its ONNX models inside the wheel, Levenshtein distance
        "hps": HPS,  # reward_fn=hpsv2: open_clip (needs a torchvision built for the installed torch)
        # reward_fn=hpsv3 / imagereward: transformers only (the hpsv3 and image-reward packages pin another
        # transformers / timm and torch, so the rewards rebuild their models on transformers' classes)
        "hpsv3": [],
        "imagereward": [],
        "vqascore": ["torchvision"],  # reward_fn=vqascore: the Qwen-VL / LLaVA processors (a torchvision for your torch)
        "judge": JUDGE,  # win_rate's judge "vlm" and the VLM judge server: the openai client
        "rewards": OCR + HPS + JUDGE,  # every optional reward; pickscore, clipscore and aesthetic need only transformers
        "models": MODELS,  # the model families' own needs (docs/model_families.md)
    },
)
