"""The front: several models behind one endpoint, each model its own engine (app.py)."""
