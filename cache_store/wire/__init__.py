"""What crosses between the gateway, the router and a replica: requests, replies, prompts, sampling."""
