"""Training data: sources (JSONL, Parquet, Hugging Face datasets) -> records -> tokens + loss mask -> packed,
phase-shifted rows -> batches (the anchor grid they are cut for: ops/anchors.py)."""

from dflash_jax.data.corpus import Corpus
from dflash_jax.data.loader import BatchLoader, merge_states
from dflash_jax.data.packing import (Cursor, PackedRow, RowPacker, packed_length, place_row, row_capacity,
                                     row_phase)
from dflash_jax.data.prefetch import Prefetcher
from dflash_jax.data.records import ChatRecord, CompletionRecord, parse_object, parse_record
from dflash_jax.data.sources import resolve_sources
from dflash_jax.data.tokenize import Document, check_chat_tokenizer, tokenize_prompt, tokenize_record

__all__ = [
    "BatchLoader",
    "ChatRecord",
    "CompletionRecord",
    "Corpus",
    "Cursor",
    "Document",
    "PackedRow",
    "Prefetcher",
    "RowPacker",
    "check_chat_tokenizer",
    "merge_states",
    "packed_length",
    "parse_object",
    "parse_record",
    "place_row",
    "resolve_sources",
    "row_capacity",
    "row_phase",
    "tokenize_prompt",
    "tokenize_record",
]
