"""The run's pictures: the pipeline timeline (Chrome trace + PNG) and the placement picture, for runs and dry runs."""
