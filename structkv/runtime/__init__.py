"""The runtime: the compressed prefill (`compress`), generation from a state, calibration of
StructKV's pivot, probes, the prefill's stats and a state's file. Built on the library below it
(models, modules, methods); the harness, the server and the command line sit on top."""
