"""Chat rendering shared by `bema eval` backends and the tiny test model.

Prompts are rendered with the checkpoint's own chat template, so each model sees the
format it was trained on; a tokenizer without one gets ChatML with a short system message.
"""

from __future__ import annotations

from pathlib import Path

from bema_cli.errors import InputError

# ChatML, as Qwen2.5 uses it; the fallback for tokenizers without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path, chat_template: str | None = None):
    """The checkpoint's tokenizer with a chat template set: `chat_template` text, its own, or ChatML.

    Returns (tokenizer, template_source) where template_source is "override", "model" or "chatml-default".
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not has_tokenizer(path):
        raise InputError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise InputError(f"{path}: cannot load tokenizer: {str(exc).splitlines()[0]}") from exc
    if chat_template is not None:
        tokenizer.chat_template, source = chat_template, "override"
    elif getattr(tokenizer, "chat_template", None):
        source = "model"
    else:
        tokenizer.chat_template, source = CHATML_TEMPLATE, "chatml-default"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, source


def load_chat(path: str | Path, chat_template: str | None = None):
    """(tokenizer, template_source, stop_ids) of a model folder: what every backend keeps of it
    besides the weights."""
    tokenizer, source = load_tokenizer(path, chat_template)
    return tokenizer, source, stop_token_ids(tokenizer, path)


def read_template(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read chat template ({exc.strerror})") from None


def render(tokenizer, messages: list[dict], generation_prompt: bool = True) -> str:
    """Messages -> the exact prompt text the model sees (special tokens included as text)."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:
        raise InputError(f"chat template failed: {str(exc).splitlines()[0]}") from exc


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of an already rendered prompt (the template holds any BOS, so add none)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer, model_path: str | Path) -> list[int]:
    """End-of-turn ids: generation_config eos ids, the tokenizer's eos, and ChatML's <|im_end|>."""
    import json

    ids: list[int] = []
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        ids.append(im_end)
    return sorted(set(ids))


def decode_completion(tokenizer, tokens: list[int], stop_ids: list[int]) -> str:
    """Generated ids -> text, cut at the first stop id (both backends decode the same way)."""
    stops = set(stop_ids)
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)
