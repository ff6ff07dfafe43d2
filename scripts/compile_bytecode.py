"""Bytecode for what kvscope and its tests import from the installed packages, on every core,
once (files already compiled are skipped). Where PYTHONDONTWRITEBYTECODE is set nothing is ever
cached on import, and each process would compile torch's and vLLM's modules again (the test
suite took half as long again).

Left out: folders nothing here imports (vLLM's model zoo and servers, transformers' other model
families, the OpenAI client's other APIs, packages' own tests, ...): 9,600 of 16,800 files. A full
test run on 2026-12-04 imported 1.3 MB of their source (against 115 MB compiled here). A module
there still works, compiled on import as without the cache. (compileall -j does the same with
one round trip to a worker per file, excluded ones too: 23 s here against 13.)

    python scripts/compile_bytecode.py SITE_PACKAGES
"""

from __future__ import annotations

import compileall
import functools
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

UNUSED = re.compile("|".join([
    r"/(tests?|examples|benchmarks)/",
    r"/site-packages/(pip|rich|markdown_it|typer|fsspec)/",
    r"/hypothesis/",  # pytest rewrites a plugin's package on import, into a cache of its own
    r"/transformers/(exporters|pipelines|cli|data)/",
    r"/transformers/models/(?!(auto|llama|mistral|qwen2|qwen3|gemma|gemma2|gemma3|gpt2)/)\w+/",
    r"/vllm/(models|third_party|vllm_flash_attn|model_executor|distributed|entrypoints|lora)/",
    r"/vllm/(compilation|tool_parsers|reasoning)/",
    r"/vllm/v1/(executor|fault_tolerance|kv_offload|pool|sample|simple_kv_offload|watermarking)/",
    r"/openai/(resources|types/(beta|admin|realtime|live|webhooks|fine_tuning))/",
    r"/huggingface_hub/(inference|cli)/",
    r"/torch/(_vendor|utils/hipify|distributed/pipelining)/",
    r"/pydantic/v1/",
    r"/pygments/lexers/(?!(python|_mapping)\.py)",
    r"/sympy/(physics|combinatorics|stats|parsing|vector|codegen|categories|liealgebras)/",
    r"/numpy/(distutils|f2py|polynomial)/",
]))


def main(root: str) -> int:
    files = [path for folder, _, names in os.walk(root) for name in names if name.endswith(".py")
             for path in [os.path.join(folder, name)] if not UNUSED.search(path)]
    with ProcessPoolExecutor() as pool:
        compiled = pool.map(functools.partial(compileall.compile_file, quiet=2), files,
                            chunksize=64)
        return 0 if all(compiled) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
