"""vllm.v1.request: the Request the offloading events name (their payload snapshots read
block_hashes, all_token_ids and lora_request from it)."""


class Request:
    def __init__(self, block_hashes, all_token_ids, lora_request=None):
        self.block_hashes = block_hashes
        self.all_token_ids = all_token_ids
        self.lora_request = lora_request
