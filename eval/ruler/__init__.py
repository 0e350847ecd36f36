"""Modified RULER needle-in-a-haystack tasks (Table 2): haystacks, sample generation, scoring."""
from eval.ruler.haystack import Haystack, load_haystack
from eval.ruler.samples import GRID, MAX_NEW_TOKENS, TASKS, VERSIONS, build_samples, cell_name, parse_cell
from eval.ruler.score import postprocess, string_match_all

__all__ = ["GRID", "MAX_NEW_TOKENS", "TASKS", "VERSIONS", "Haystack", "build_samples", "cell_name", "load_haystack",
           "parse_cell", "postprocess", "string_match_all"]
