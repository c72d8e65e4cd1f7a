"""Image-checking ensemble stand-in: decodes the request's images as upstream's preprocessing does (image_bytes_input:
decoded uint8 pixels [batch, images, H, W, 3]; image_url_input: data:image/...;base64 URLs), requires one
``<|image|>`` per image at the start of ``text_input``, then streams ``max_tokens`` responses of one token each; the
first response's text names the decoded sizes (``WxH`` per image)."""

import base64
import io

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image


def _images(request):
    raw = pb_utils.get_input_tensor_by_name(request, "image_bytes_input")
    urls = pb_utils.get_input_tensor_by_name(request, "image_url_input")
    if (raw is None) == (urls is None):
        raise ValueError("send exactly one of image_bytes_input, image_url_input")
    if raw is not None:
        arr = raw.as_numpy()
        if arr.dtype != np.uint8 or arr.ndim != 5 or arr.shape[0] != 1 or arr.shape[-1] != 3:
            raise ValueError(f"image_bytes_input: want uint8 [1, images, H, W, 3], got {arr.dtype} {list(arr.shape)}")
        return [Image.fromarray(a, "RGB") for a in arr[0]]
    out = []
    for url in urls.as_numpy().reshape(-1):
        url = url.decode() if isinstance(url, bytes) else str(url)
        head, _, payload = url.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64")):
            raise ValueError(f"image_url_input: not a data:image URL: {url[:40]}")
        img = Image.open(io.BytesIO(base64.b64decode(payload)))
        img.load()
        out.append(img)
    return out


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
                n = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
                images = _images(request)
                if not text.startswith("<|image|>" * len(images)) or text.startswith("<|image|>" * (len(images) + 1)):
                    raise ValueError(f"text_input must start with one <|image|> per image ({len(images)})")
            except Exception as e:  # noqa: BLE001 - any bad input is this request's error
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            sizes = " ".join(f"{im.size[0]}x{im.size[1]}" for im in images)
            for i in range(n):
                out = [pb_utils.Tensor("text_output", np.array([(sizes if i == 0 else " a").encode()], dtype=np.object_)),
                       pb_utils.Tensor("num_output_tokens", np.array([1], dtype=np.int32))]
                sender.send(pb_utils.InferenceResponse(output_tensors=out))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
