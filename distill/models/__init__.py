"""Networks: conditioning encoders, the MoE and preconditioned UNets, the CLIP, the classifiers and the VAE's latent
helpers, the teacher record. The builders that make students of them are in ``distill.students``."""
