"""Planning the cluster: how many prefill and decode nodes a workload needs (`pdserve plan`)."""
