"""The user's step as the library reads it: traced once into a closure-free
function (`step_fn`), checked to keep rows rows (`row_checks`), split into its
state-independent part (`hoist`), measured for what a kernel program holds
(`footprint`), and evaluated inside a kernel with a backend's rewrites
(`jaxpr_eval`; the GPU's tanh and logistic: `fast_math`). Nothing here imports
the kernels.
"""
