"""Test plugins for model-router, discovered through the `model_router.plugins` entry point."""
