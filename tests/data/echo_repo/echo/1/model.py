"""Decoupled echo model for the serve tests: one response per input element, then FINAL.

Importing numpy and ``pipeline`` checks that the stub runs in trtpipe's venv (PATH/site-packages).
"""

import numpy as np
import triton_python_backend_utils as pb_utils

import pipeline  # noqa: F401  (proves the editable trtpipe install is importable from the stub)


class TritonPythonModel:
    """Streams ``IN[i]`` back as ``OUT=[IN[i]]``, one response each."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            for v in values:
                out = pb_utils.Tensor("OUT", np.array([v], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
