"""Beam search through the stages of a running pipeline: BLEU during training without a second copy of
the model anywhere.

Every rank of a pipeline runs the same search (model/search.py) in lockstep over the same sentences.
The source goes through the encoder stage by stage, and every stage keeps the encoder output its
decoder layers attend to. At each output position the stage holding the decoder embedding embeds the
newest tokens, each stage runs its own decoder layers from its own cache (model/cache.py) and sends
the hidden state on, and the last stage projects it, picks each sentence's 2 x beam best candidates
and broadcasts them (a few numbers per sentence) to its pipeline's stages, which all advance the
search alike. Each data-parallel replica decodes its share of the sentences.

Per output position that costs one point-to-point message per stage boundary and one broadcast per
pipeline, and the stages work one after the other: decoding runs at the speed of one process
holding the whole model, plus the messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import sentencepiece as spm
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn

from fathom.common.bleu import corpus_bleu
from fathom.common.files import write_atomic
from fathom.corpus.batches import ParallelCorpus, length_batches, with_eos
from fathom.corpus.dataset import BinarizedCorpus
from fathom.corpus.text import read_lines
from fathom.model.cache import DecoderCache
from fathom.model.layers import DecoderLayer, EncoderLayer
from fathom.model.model_config import ModelConfig
from fathom.model.parts import model_parts, module_names
from fathom.model.search import CachedRows, Candidates, Choose, Hypothesis, log_probs, search
from fathom.pipeline.config.run_config import ValidBleu
from fathom.pipeline.engine.internals import built_layer, built_stage_bounds


def stage_parts(pipe: PipelineModule, cfg: ModelConfig) -> list[tuple[str, nn.Module]]:
    """(reference module name, module) of each layer of this rank's stage, in order; a tied table under
    the name of each of its uses."""
    start, stop = built_stage_bounds(pipe)[pipe.stage_id : pipe.stage_id + 2]
    parts = []
    for index, part in enumerate(model_parts(cfg)[start:stop], start):
        parts.append((part.name, built_layer(pipe, index, part.tie)))
    return parts


class Stage:
    """This rank's place in its pipeline and its layers, as decoding needs them; the same for every batch."""

    def __init__(self, engine: deepspeed.PipelineEngine, cfg: ModelConfig):
        self.parts = stage_parts(engine.module, cfg)
        grid, stage, stages = engine.grid, engine.stage_id, engine.num_stages
        self.prev = grid.stage_to_global(stage - 1) if stage > 0 else None
        self.next = grid.stage_to_global(stage + 1) if stage < stages - 1 else None
        self.last, self.group = grid.stage_to_global(stages - 1), grid.get_pipe_parallel_group()
        self.device, self.dtype = engine.device, next(engine.module.parameters()).dtype
        self.dim = cfg.embed_dim
        # the stages from the one that embeds target tokens on take part in every step
        self.decodes = built_stage_bounds(engine.module)[stage + 1] > module_names(cfg).index("decoder.embed_tokens")
        self.embeds = any(name == "decoder.embed_tokens" for name, _ in self.parts)
        self.decoder_layers = sum(name.startswith("decoder.layers.") for name, _ in self.parts)


class StageDecoder(CachedRows):
    """This rank's part of the search's decoding steps (a model.search.StepDecoder)."""

    def __init__(self, stage: Stage, src_tokens: torch.Tensor, beam: int):
        self.stage, self.beam = stage, beam
        super().__init__(DecoderCache(stage.decoder_layers, beam), src_tokens, self.encode(src_tokens))

    def receive(self, *shape: int) -> torch.Tensor:
        stage = self.stage
        buffer = torch.empty(*shape, stage.dim, dtype=stage.dtype, device=stage.device)
        dist.recv(buffer, src=stage.prev)
        return buffer

    def encode(self, src_tokens: torch.Tensor) -> torch.Tensor:
        """The encoder output (complete on every stage past the encoder's last layer)."""
        stage = self.stage
        x = self.receive(*src_tokens.shape) if stage.prev is not None else None
        for name, module in stage.parts:
            if name == "encoder.embed_tokens":
                x = module.embed(src_tokens)
            elif name.startswith("encoder.layers."):
                x = EncoderLayer.forward(module, x, src_tokens)
            elif name == "encoder.layer_norm":
                x = nn.LayerNorm.forward(module, x)
        if stage.next is not None:
            dist.send(x.contiguous(), dst=stage.next)
        return x

    def step(self, tokens: torch.Tensor, choose: Choose) -> Candidates:
        stage, rows = self.stage, tokens.size(0)
        candidates = torch.empty(3, rows // self.beam, 2 * self.beam, dtype=torch.float64, device=stage.device)
        if stage.decodes:
            y = None if stage.embeds else self.receive(rows, 1)
            layer = 0
            for name, module in stage.parts:
                if name == "decoder.embed_tokens":
                    y = module.embed(tokens, self.cache.length)
                elif name.startswith("decoder.layers."):
                    y = DecoderLayer.forward(module, y, self.encoder_out, self.src_tokens, self.cache.layers[layer])
                    layer += 1
                elif name == "decoder.layer_norm":
                    y = nn.LayerNorm.forward(module, y)
                elif name == "decoder.output_projection":
                    # exact in float64: fp32 scores and integer indices
                    candidates = torch.stack([c.double() for c in choose(log_probs(module.project(y[:, -1])))])
            self.cache.length += 1
            if stage.next is not None:
                dist.send(y.contiguous(), dst=stage.next)
        if stage.next is not None or stage.prev is not None:
            dist.broadcast(candidates, src=stage.last, group=stage.group)
        scores, beam, token = candidates
        return scores.float(), beam.long(), token.long()


@torch.no_grad()
def translate(
    engine: deepspeed.PipelineEngine, cfg: ModelConfig, sources: list[torch.Tensor], search_cfg: ValidBleu
) -> list[Hypothesis]:
    """Best hypotheses of this data-parallel replica's share of `sources` (every `size`-th sentence from
    its rank), on every stage; sentences batched by length."""
    grid = engine.grid
    mine = range(grid.get_data_parallel_rank(), len(sources), grid.get_data_parallel_world_size())
    found: dict[int, Hypothesis] = {}
    stage = Stage(engine, cfg)
    was_training = engine.module.training
    engine.module.eval()
    try:
        for batch in length_batches(sources, mine, search_cfg.batch_size):
            src = with_eos([sources[i] for i in batch]).to(engine.device)
            decoder = StageDecoder(stage, src, search_cfg.beam)
            hypotheses = search(decoder, src, cfg.max_positions, search_cfg)
            found.update(zip(batch, hypotheses, strict=True))
    finally:
        engine.module.train(was_training)
    return [found[i] for i in sorted(found)]


@dataclass
class BleuSet:
    """Validation sentences with their references, and how hypotheses become text to score."""

    sources: list[torch.Tensor]
    references: list[str]
    detokenize: Callable[[list[int]], str]
    lang: str | None  # the target language, which sacreBLEU's tokenizer follows (None: the synthetic task)


def bleu_set(corpus: ParallelCorpus, sentences: int) -> BleuSet:
    """The first `sentences` validation pairs (0: all). Prepared data is scored as sacreBLEU would score
    translations of the raw text (SentencePiece removed); the synthetic task's token ids are its words."""
    count = len(corpus) if sentences == 0 else min(sentences, len(corpus))
    sources = [corpus.pair(i)[0] for i in range(count)]
    if isinstance(corpus, BinarizedCorpus):
        pieces = spm.SentencePieceProcessor(model_file=str(corpus.sentencepiece_model(corpus.tgt)))
        references = read_lines(corpus.references())[:count]
        return BleuSet(sources, references, lambda ids: corpus.target_text(ids, pieces), corpus.tgt)
    references = [" ".join(map(str, corpus.pair(i)[1].tolist())) for i in range(count)]
    return BleuSet(sources, references, lambda ids: " ".join(map(str, ids)), None)


def valid_bleu(
    engine: deepspeed.PipelineEngine, cfg: ModelConfig, data: BleuSet, search_cfg: ValidBleu, output: Path
) -> tuple[float, float]:
    """(sacreBLEU of the model's translations of the validation set, seconds it took), the same on every
    rank; the translations go to `output`, one a line."""
    tick = time.perf_counter()
    mine = [h.tokens for h in translate(engine, cfg, data.sources, search_cfg)]
    grid = engine.grid
    score = torch.zeros(1, dtype=torch.float64, device=engine.device)
    if engine.is_last_stage():
        shares: list[list[list[int]]] = [[] for _ in range(grid.get_data_parallel_world_size())]
        dist.all_gather_object(shares, mine, group=grid.get_data_parallel_group())
        size = len(shares)
        translations = [data.detokenize(shares[i % size][i // size]) for i in range(len(data.sources))]
        score += corpus_bleu(translations, data.references, data.lang)
        if grid.get_data_parallel_rank() == 0:
            output.parent.mkdir(exist_ok=True)
            write_atomic(output, "".join(line + "\n" for line in translations))
    dist.all_reduce(score, op=dist.ReduceOp.MAX)  # from the last stages (all alike) to every rank
    return score.item(), time.perf_counter() - tick
