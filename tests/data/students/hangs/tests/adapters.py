"""An attention whose forward never returns (a deadlock, as a wrong collective makes one)."""

import time


class Hangs:
    @staticmethod
    def apply(q, k, v, is_causal=False):
        while True:
            time.sleep(1)


def get_flashattention_autograd_function_pytorch():
    return Hangs
