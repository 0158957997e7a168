"""The loop as plain XLA: the bucketed forward (`xla_forward`) and the window
backward (`xla_backward`), what runs where no kernel does.
"""
