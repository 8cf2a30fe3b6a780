"""The controller service: runs BidBrain for submitted jobs against EC2 and the store."""
