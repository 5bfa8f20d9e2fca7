"""Text in and out through a checkpoint's tokenizer.json (the `tokenizers` package), when there is one."""

from __future__ import annotations

from pathlib import Path

from kvwall.errors import KvwallError, first_line


class Text:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises plain Exception for any file it cannot read
            raise KvwallError(f"{path} is not a tokenizer file the tokenizers package can read ({first_line(e)}); "
                              "re-download it with the checkpoint, or use --prompt-ids") from None

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text).ids
        if not ids:
            raise KvwallError("the prompt encodes to no tokens; give a longer prompt")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(checkpoint: str | Path) -> Text | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json or `tokenizers` is missing;
    a .gguf file carries its own (rebuilt from its metadata)."""
    if Path(checkpoint).suffix.lower() == ".gguf":
        try:
            from kvwall.engine.gguf_tokenizer import gguf_tokenizer

            return gguf_tokenizer(checkpoint)
        except ImportError:
            return None
    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Text(path)
    except ImportError:
        return None
