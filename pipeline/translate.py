"""Translate a prepared split with a pipeline checkpoint and score it with sacreBLEU.

    python scripts/generate.py --checkpoint SAVE_DIR [--tag TAG] --data DIR --subset test \\
        [--beam 4] [--lenpen 0.6] [--batch-size 64] [--output FILE]

The checkpoint (any depth, any stage count) loads into the single-process model; hypotheses are
detokenized with the data's SentencePiece model and scored against the split's raw references
(cased, detokenized, sacreBLEU's default 13a tokenizer). The last line printed is the signature.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from sacrebleu.metrics import BLEU, CHRF
from tqdm import tqdm

from model.config import exit_on_config_error
from model.search import beam_search
from pipeline.checkpoint import check_vocab, load_reference
from pipeline.corpus import BinarizedCorpus, sentencepiece_model
from pipeline.data import collate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of a run")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. best or global_step4000 (default: latest)")
    parser.add_argument("--data", required=True, help="directory written by scripts/prepare_data.py")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--lenpen", type=float, default=1.0, help="fairseq's length penalty (scores / len**lenpen)")
    parser.add_argument("--max-len-a", type=float, default=0.0)
    parser.add_argument("--max-len-b", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--output", default=None, help="hypotheses file (default: SAVE_DIR/generate-SUBSET.txt)")
    return parser.parse_args(argv)


def translate(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    data = Path(args.data)
    corpus = BinarizedCorpus(data, args.subset)
    model = load_reference(args.checkpoint, args.tag)
    check_vocab(args.checkpoint, model.cfg, corpus, data)
    detok = spm.SentencePieceProcessor(model_file=str(sentencepiece_model(data, corpus.tgt)))
    order = np.argsort(corpus.sources.lengths, kind="stable")  # similar lengths batch together
    hypotheses: list[str] = [""] * len(corpus)
    batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    for batch in tqdm(batches, desc=f"translating {args.subset}", unit="batch", file=sys.stderr):
        (src, _), _ = collate([corpus.pair(int(i)) for i in batch])
        outputs = beam_search(model, src, args.beam, args.lenpen, args.max_len_a, args.max_len_b)
        for index, hypothesis in zip(batch, outputs, strict=True):
            hypotheses[int(index)] = detok.decode_pieces(corpus.tgt_dict.decode(hypothesis.tokens))
    references = (data / f"{args.subset}.raw.{corpus.tgt}").read_text(encoding="utf-8").splitlines()
    return hypotheses, references


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    with exit_on_config_error():
        hypotheses, references = translate(args)
    output = Path(args.output or Path(args.checkpoint) / f"generate-{args.subset}.txt")
    output.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    bleu, chrf = BLEU(), CHRF()
    print(f"wrote {len(hypotheses)} hypotheses to {output}")
    print(bleu.corpus_score(hypotheses, [references]))
    print(chrf.corpus_score(hypotheses, [references]))
    print(bleu.get_signature())
