"""Drafting strategies behind one interface; adding a strategy is adding one class."""

from mirrorspec.drafting.base import Drafter, Proposal, RankedTokens
from mirrorspec.drafting.draft_model import DraftModelDrafter
from mirrorspec.drafting.hybrid import HybridDrafter
from mirrorspec.drafting.ngram import NgramDrafter

__all__ = ["DraftModelDrafter", "Drafter", "HybridDrafter", "NgramDrafter", "Proposal", "RankedTokens"]
