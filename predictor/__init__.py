"""`tollgate predictor`: learned output-length reservations (issue 18). Training and evaluation
read the event log; the trained model is exported to plain arithmetic (`domain.prediction`), so
nothing an edge imports from here pulls in torch (only `predictor.train` does, when it runs)."""
