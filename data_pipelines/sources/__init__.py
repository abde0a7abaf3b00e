"""Local data sources that become DataComp-layout shards: Fashion-MNIST, ImageFolder, tables, emoji."""
