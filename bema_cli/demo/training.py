"""Training for `bema demo`: pretrain a small base model, then fine-tune it the paper's way.

The fine-tune uses the HF Trainer exactly as a user would on a GPU: small batch, constant
learning rate, no weight decay, `checkpoint-<step>` folders every `save_every` steps with
model files only (`save_only_model=True`).
"""

from __future__ import annotations

import time
from pathlib import Path

from bema_cli import output

TRAIN_THREADS = 2  # fixed, so a 2-core laptop and a 64-core server sum in the same order


def _pad_collator(pad_id: int):
    """Right-pad a batch of {"input_ids", "labels"} lists; labels padded with -100 (ignored)."""
    import torch

    def collate(batch: list[dict]) -> dict:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def encode_text(tokenizer, texts: list[str], max_len: int = 256) -> list[dict]:
    """Pretraining examples: every token is a target; documents end with the EOS token."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_len - 1] + [tokenizer.pad_token_id]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def encode_chat(tokenizer, conversations: list[list[dict]], max_len: int = 384) -> list[dict]:
    """SFT examples: the whole rendered conversation is learned, prompt included.

    That is what the held-out `loss` task of `bema eval` measures (every token of the chat),
    and what TRL's SFTTrainer does by default for conversations.
    """
    out = []
    for messages in conversations:
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        ids = ids["input_ids"][:max_len]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


class _ListDataset:
    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _progress_callback(description: str, total: int, log_every: int):
    """A TrainerCallback showing a rich bar on a terminal and a plain line every `log_every` steps otherwise."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def __init__(self):
            self.started = time.perf_counter()
            self.ctx = output.progress()
            self.bar = self.ctx.__enter__()
            self.task = self.bar.add_task(description, total=total)

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(self.task, completed=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:
                return
            step, loss = state.global_step, float(logs["loss"])
            self.bar.update(self.task, description=f"{description} (loss {loss:.3f})")
            if not output.progress_enabled() and (step % log_every == 0 or step == total):
                elapsed = time.perf_counter() - self.started
                output.log(f"  {description}: step {step}/{total}  train loss {loss:.3f}  {elapsed:.0f}s")

        def on_train_end(self, args, state, control, **kwargs):
            self.ctx.__exit__(None, None, None)

    return Progress()


def train(
    model,
    tokenizer,
    examples: list[dict],
    out_dir: Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    scheduler: str,
    save_every: int | None,
    seed: int,
    description: str,
    warmup_steps: int = 0,
) -> None:
    """One HF Trainer run on CPU. save_every=None: no checkpoints (the pretraining run).

    Same software, same seed, same numbers: a CPU reduction's order depends on the thread count,
    so training runs on TRAIN_THREADS threads on any machine, with deterministic algorithms
    (`full_determinism`); the instruction set is pinned by `bema demo` (commands/demo.py)."""
    import torch
    import transformers
    from transformers import PrinterCallback, Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # "Writing model shards" bars; we draw our own
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        lr_scheduler_type=scheduler,
        warmup_steps=warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=max(1, min(10, steps // 10)),
        save_strategy="steps" if save_every else "no",
        save_steps=save_every or 500,
        save_only_model=True,
        save_total_limit=None,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
        data_seed=seed,
        full_determinism=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_ListDataset(examples),
        data_collator=_pad_collator(tokenizer.pad_token_id),
        processing_class=tokenizer,  # checkpoints then carry the tokenizer, as `bema eval` needs
        callbacks=[_progress_callback(description, steps, log_every=max(1, steps // 10))],
    )
    trainer.remove_callback(PrinterCallback)  # it prints raw log dicts on stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)  # full_determinism turned it on, for this run only
