"""A CLIP tokenizer for a small vocabulary: byte-level base symbols (any text still tokenizes) plus
BPE merges learned on the vocabulary's words, so each of those words is a single token.

The files it saves are the standard CLIP tokenizer files, loaded by ``CLIPTokenizer.from_pretrained``.
"""

from __future__ import annotations

from collections import Counter

from transformers import CLIPTokenizer

END_OF_WORD = "</w>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode symbol map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_vocab() -> dict[str, int]:
    """Special tokens, then every byte symbol alone and at the end of a word (CLIP's base vocabulary)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for symbol in bytes_to_unicode().values():
        vocab.setdefault(symbol, len(vocab))
        vocab.setdefault(symbol + END_OF_WORD, len(vocab))
    return vocab


def learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE training on a word list until every word is one symbol (ties broken by first occurrence).

    Applying the merges in order to a training word reproduces the training segmentation, so each
    of ``words`` tokenizes to exactly one token.
    """
    symbols_of = bytes_to_unicode()
    segmentations = []
    for word in dict.fromkeys(w.lower() for w in words):
        chars = [symbols_of[b] for b in word.encode("utf-8")]
        chars[-1] += END_OF_WORD
        segmentations.append(chars)
    merges = []
    while True:
        pairs = Counter()
        for seg in segmentations:
            pairs.update(zip(seg, seg[1:]))
        if not pairs:
            return merges
        best = max(pairs.items(), key=lambda item: item[1])[0]  # Counter keeps insertion order on ties
        merges.append(best)
        for k, seg in enumerate(segmentations):
            merged, i = [], 0
            while i < len(seg):
                if i + 1 < len(seg) and (seg[i], seg[i + 1]) == best:
                    merged.append(seg[i] + seg[i + 1])
                    i += 2
                else:
                    merged.append(seg[i])
                    i += 1
            segmentations[k] = merged


def build_tokenizer(words: list[str], model_max_length: int) -> CLIPTokenizer:
    """A CLIPTokenizer whose vocabulary is the byte-level base plus one token per word of ``words``."""
    vocab = byte_level_vocab()
    merges = learn_merges(words)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def save_classic_files(tokenizer: CLIPTokenizer, directory) -> None:
    """Also write vocab.json and merges.txt, which transformers 4's slow CLIPTokenizer reads."""
    import json
    from pathlib import Path

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    directory = Path(directory)
    (directory / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
