"""The trainers of the digits world's shipped networks, each a method (``method=clip``, ``classifier``,
``noisy_classifier``, ``vae``) run by its experiment (``+exp=asset_*``, ``+exp=teacher``)."""
