"""The cloud adapter: buy, list and release EC2 spot/on-demand instances (boto3; moto offline)."""
