from setuptools import find_packages, setup

setup(
    name="megatron_bmw",
    version="0.1.0",
    description="Megatron-style GPT pretraining with an automatic parallel-configuration planner",
    packages=find_packages(include=["megatron_bmw", "megatron_bmw.*"]),
    package_data={"megatron_bmw.planner": ["clusters/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.3",
        "numpy",
        "sentencepiece",
        "tensorboard",
        "regex",
        "pyyaml",
        "xxhash>=3",  # checkpoint checksums (training/checksums.py; SHA-256 without it)
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist>=3", "transformers", "tokenizers", "megatron-core==0.16.1",
                 "tiktoken"],  # TikTokenizer's tests compare the pure-Python BPE with it
        "plot": ["matplotlib"],
    },
)
