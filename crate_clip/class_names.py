"""Class names of the built-in labelled data sets, in label order: the one list that data_pipelines (eval folder
names, classnames.txt, caption synonyms) and eval (zero-shot prompts) both derive from."""

# Fashion-MNIST's own label names (Xiao et al., 2017), as its README lists them for labels 0..9.
FASHION_MNIST_CLASSNAMES = (
    "T-shirt/top", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)
