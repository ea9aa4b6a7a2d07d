"""The rows of A-matrices inside auto_LiRPA (the neurons of the layer being bounded, and the output
node's spec rows) and their α, dealt over the ranks, so each rank back-substitutes (and holds the
A-matrices and autograd state of) only its rows; DESIGN's second kind of tensor (the weights are
:mod:`..weights`, the domains :mod:`..search`).

* :mod:`.deal`: which rank bounds which row, and the passes every rank runs in lockstep;
* :mod:`.passes`: the intermediate layers' rows (``batched_backward``, ``get_sparse_C``), conv layers by
  whole channels, a layer that runs out of memory in passes of half as many rows;
* :mod:`.spec`: the output node's spec rows in α-CROWN's iterations;
* :mod:`.alpha`: each rank keeps the α of its own rows;
* :mod:`.grads`: the gradient protocol that makes α-CROWN over dealt rows one process's.

Every replacement is a ``make(run, original)`` of :mod:`..table`; the state they share is the run's
:class:`~..run.Rows`.
"""
