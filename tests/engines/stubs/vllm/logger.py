"""vllm.logger: standard logging, with vLLM's *_once helpers."""
import logging


class _Logger(logging.LoggerAdapter):
    _seen = set()

    def process(self, msg, kwargs):
        return msg, kwargs

    def _once(self, level, msg, *args):
        if (level, msg) not in self._seen:
            self._seen.add((level, msg))
            self.log(level, msg, *args)

    def info_once(self, msg, *args, **_):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **_):
        self._once(logging.WARNING, msg, *args)

    def debug_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
