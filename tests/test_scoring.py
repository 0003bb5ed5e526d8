"""The two ways a translation is scored (translation/scoring.py), on hand-built cases whose BLEU is worked
out here by hand; on real text the tokenized BLEU was checked against multi-bleu.perl itself."""

import io
import math

import pytest

from fathom.common.errors import ConfigError
from fathom.translation.scoring import print_scores, split_compounds, tokenized, tokenized_bleu


def bleu(*precisions: float, bp: float = 1.0) -> float:
    return 100 * bp * math.exp(sum(math.log(p) for p in precisions) / 4)


def score(line: str) -> float:
    return float(line.split()[3].rstrip(","))


@pytest.mark.parametrize(
    "line, split",
    [
        ("ein Kaffee-Automat", "ein Kaffee ##AT##-##AT## Automat"),
        ("a-b-c", "a ##AT##-##AT## b-c"),  # perl's s{}{}g: the matches do not overlap
        ("x - y", "x - y"),
        ("2-3 Tage", "2 ##AT##-##AT## 3 Tage"),
        ("-Anfang Ende-", "-Anfang Ende-"),
    ],
)
def test_compounds_split_as_the_papers_scripts_split_them(line, split):
    assert split_compounds(line) == split


def test_the_moses_tokenizer_splits_punctuation_and_only_german_splits_compounds():
    # fairseq's test sets: -a splits hyphens, compound_split_bleu.sh then splits the "@-@" of German ones
    assert tokenized(['"Ja", sagte der Kaffee-Experte.'], "de") == [
        '" Ja " , sagte der Kaffee @ ##AT##-##AT## @ Experte .'
    ]
    assert tokenized(["Hello, well-known world’s!"], "en") == ["Hello , well @-@ known world 's !"]


def test_tokenized_bleu_is_multi_bleus_on_hand_built_cases():
    # 6 words each: 5/6 unigrams, 3/5 bigrams, 2/4 trigrams, 1/3 4-grams match
    line = tokenized_bleu(["the cat sat on the mat"], ["the cat sat on a mat"], "en")
    assert score(line) == pytest.approx(bleu(5 / 6, 3 / 5, 2 / 4, 1 / 3), abs=0.005)
    assert line.endswith("hyp_len=6, ref_len=6) [moses tokenizer -a, multi-bleu, en]")
    # every n-gram of a short hypothesis matches: the brevity penalty alone, exp(1 - 6/4)
    short = tokenized_bleu(["the cat sat on"], ["the cat sat on the mat"], "en")
    assert score(short) == pytest.approx(bleu(1, 1, 1, 1, bp=math.exp(1 - 6 / 4)), abs=0.005)
    # no 4-gram matches: multi-bleu.perl does not smooth, the score is 0
    assert score(tokenized_bleu(["a b c d"], ["a b c e"], "en")) == 0


def test_a_german_compound_counts_as_five_tokens():
    hypothesis, reference = (
        ["Der Kaffee-Maschine ist seit heute Morgen kaputt."],
        ["Der Kaffee-Automat ist seit heute Morgen kaputt."],
    )
    # split: "Kaffee @ ##AT##-##AT## @ Automat", 12 tokens, of which 11/12, 9/11, 7/10, 5/9 n-grams match;
    # English rules: "Kaffee @-@ Automat", 10 tokens, 9/10, 7/9, 5/8, 3/7
    german = tokenized_bleu(hypothesis, reference, "de")
    assert score(german) == pytest.approx(bleu(11 / 12, 9 / 11, 7 / 10, 5 / 9), abs=0.005)
    assert german.endswith("[moses tokenizer -a, compounds split, multi-bleu, de]")
    english = tokenized_bleu(hypothesis, reference, "en")
    assert score(english) == pytest.approx(bleu(9 / 10, 7 / 9, 5 / 8, 3 / 7), abs=0.005)


def test_scores_print_tokenized_bleu_then_sacrebleus_with_its_signature_last():
    out = io.StringIO()
    print_scores(["Der Hund rennt."], ["Der Hund rennt."], "de", out)
    lines = out.getvalue().splitlines()
    assert [line.split(" = ")[0] for line in lines[:3]] == ["tokenized BLEU", "BLEU", "chrF2"]
    assert score(lines[0]) == 100 and lines[-1].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_chinese_japanese_and_korean_are_scored_as_sacrebleus_command_scores_them():
    """Scoring used sacreBLEU's 13a tokenizer and Moses, which do not segment CJK: a Chinese hypothesis one
    character off its reference scored BLEU = 0.00 and tokenized BLEU = 0.00 where `sacrebleu -l en-zh`
    (tok:zh) gives 81.87."""
    out = io.StringIO()
    print_scores(["我喜欢猫咪"], ["我喜欢猫咪了"], "zh", out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("tokenized BLEU = 81.87,"), lines[0]
    assert lines[0].endswith("[sacreBLEU's zh tokenizer, multi-bleu, zh]"), lines[0]
    assert lines[1].startswith("BLEU = 81.87 ") and "tok:zh" in lines[-1]
    out = io.StringIO()
    print_scores(["Der Hund rennt."], ["Der Hund rennt."], "de", out)
    assert "tok:13a" in out.getvalue().splitlines()[-1]


def test_a_tokenizer_whose_extra_is_missing_is_one_line_naming_it(monkeypatch):
    from fathom.common import bleu

    def without_mecab(tokenize: str, **options):
        raise RuntimeError("Japanese tokenization requires extra dependencies")  # what sacreBLEU raises

    monkeypatch.setattr(bleu, "BLEU", without_mecab)
    with pytest.raises(ConfigError, match=r"^BLEU for ja: sacreBLEU tokenizes it with ja-mecab, which needs "
                                          r"sacrebleu\[ja\]: pip install 'sacrebleu\[ja\]'$"):  # fmt: skip
        bleu.bleu_metric("ja")
