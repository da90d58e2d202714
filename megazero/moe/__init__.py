"""Mixture of Experts: ``router`` holds the routing, load-balancing and capacity
rules as plain functions of a micro-batch's router logits."""
