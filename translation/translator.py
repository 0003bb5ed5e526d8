"""A trained run as a translator in Python: its checkpoint in the single-process model on a device, with its
data's dictionaries and SentencePiece models, decoding raw text with the beam search (model/search.py).
scripts/translate.py and scripts/generate.py are its commands; translation/decoding_flags.py their shared flags."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import sentencepiece as spm
import torch
from tqdm import tqdm

from fathom.common.errors import ConfigError
from fathom.common.machine import native_bf16_cpu
from fathom.common.sections import check_fields
from fathom.corpus.batches import length_batches, with_eos
from fathom.corpus.dataset import PreparedData, check_vocab
from fathom.corpus.text import blank
from fathom.model.model_config import DTYPES
from fathom.model.search import Hypothesis, SearchConfig, beam_search
from fathom.model.trained import load_reference
from fathom.model.transformer import Transformer

SearchFn = Callable[[Transformer, torch.Tensor, SearchConfig], list[Hypothesis]]


def device_and_dtype(device: str | None, precision: str) -> tuple[torch.device, torch.dtype]:
    """Where and in what precision to decode; fails in one line where the device cannot."""
    try:
        where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device {device}: not a device; use cpu, cuda or cuda:N") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device here; use --device cpu")
    if where.type == "cpu" and precision == "fp16":
        raise ConfigError("--precision fp16: needs a GPU; on CPU use bf16 (where the CPU has avx512_bf16) or fp32")
    if where.type == "cpu" and precision == "bf16" and not native_bf16_cpu():
        print("fathom: warning: this CPU has no avx512_bf16 or amx_bf16: bf16 runs emulated, far slower than fp32",
              file=sys.stderr)  # fmt: skip
    return where, DTYPES[precision]


class Translator:
    """A trained model on a device, with its data's dictionaries and SentencePiece models, decoding with
    `search_cfg`. From Python:

        translator = Translator.from_checkpoint("checkpoints/my_pair", "data-bin/my_pair", tag="best")
        translator.translate(["Ein Hund rennt über die Wiese."])
    """

    def __init__(self, model: Transformer, data: PreparedData, search_cfg: SearchConfig):
        self.model, self.data, self.search_cfg = model, data, search_cfg
        self.tokenizer, self.detokenizer = (
            spm.SentencePieceProcessor(model_file=str(data.sentencepiece_model(lang))) for lang in (data.src, data.tgt)
        )

    @classmethod
    def from_checkpoint(
        cls,
        run_dir: str | Path,
        data: str | Path,
        tag: str | None = None,
        device: str | None = None,
        precision: str = "fp32",
        search: SearchConfig | None = None,
    ) -> Translator:
        """The run's checkpoint `tag` (default: latest; any depth, any stage count) in the single-process
        model, on `device` (default: cuda if there is one) in `precision` (fp32, bf16, fp16), with the
        prepared data directory `data` it was trained on. Fails in one ConfigError line where the search
        settings, the device, the data or the checkpoint cannot be used."""
        search = SearchConfig() if search is None else search
        check_fields(search, "search")
        where, dtype = device_and_dtype(device, precision)
        prepared = PreparedData(data)
        model = load_reference(run_dir, tag).to(where, dtype)
        check_vocab(run_dir, model.cfg, prepared)
        return cls(model, prepared, search)

    def translate(self, lines: list[str], progress: str | None = None) -> list[str]:
        """Translations of `lines` in their order, decoded in batches of similar source lengths; a line
        that shows nothing (corpus.text.blank) gives an empty line and is not decoded; with `progress`, a
        progress bar of that name on stderr."""
        sources = self.encode(lines)
        todo = [i for i, line in enumerate(lines) if not blank(line)]
        found = self.search(sources, length_batches(sources, todo, self.search_cfg.batch_size), progress)
        return ["" if hypothesis is None else self.detokenize(hypothesis) for hypothesis in found]

    def encode(self, lines: list[str]) -> list[torch.Tensor]:
        """Source token ids of each line; a line over the model's positions is cut to fit."""
        room = self.model.cfg.max_positions - 1  # and the eos
        sources = []
        for lineno, pieces in enumerate(self.tokenizer.encode(lines, out_type=str), 1):
            if len(pieces) > room:
                print(
                    f"fathom: warning: line {lineno}: {len(pieces)} pieces, cut to the model's {room} "
                    f"(model.max_positions {room + 1})",
                    file=sys.stderr,
                )
                pieces = pieces[:room]
            sources.append(torch.tensor(self.data.src_dict.encode(pieces), dtype=torch.long))
        return sources

    def search(
        self,
        sources: list[torch.Tensor],
        batches: list[list[int]],
        progress: str | None = None,
        search: SearchFn = beam_search,
    ) -> list[Hypothesis | None]:
        """Best hypothesis per source (token ids without eos), decoded in `batches` (lists of indices into
        `sources`), in input order, None for a source in no batch; `search` (model.search.beam_search's
        signature) lets a benchmark time another search on the same batches."""
        hypotheses: list[Hypothesis | None] = [None] * len(sources)
        for batch in tqdm(batches, desc=progress, unit="batch", file=sys.stderr, disable=progress is None):
            found = search(self.model, with_eos([sources[i] for i in batch]), self.search_cfg)
            for index, hypothesis in zip(batch, found, strict=True):
                hypotheses[index] = hypothesis
        return hypotheses

    def detokenize(self, hypothesis: Hypothesis) -> str:
        return self.data.target_text(hypothesis.tokens, self.detokenizer)
