"""The demo draft's recipe: training prompts, target-written training data, distillation.

``mirrorspec demo --rebuild`` runs it end to end (``build.py``); the result ships in
``mirrorspec/models/demo_draft``.
"""
