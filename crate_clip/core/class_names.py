"""Class names of the built-in labelled data sets, in label order, and their zero-shot prompt templates: the one
list that data_pipelines (eval folder names, classnames.txt, zeroshot_classification_templates.txt, caption
synonyms) and eval (zero-shot prompts) both derive from."""

# Fashion-MNIST's own label names (Xiao et al., 2017), as its README lists them for labels 0..9.
FASHION_MNIST_CLASSNAMES = (
    "T-shirt/top", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)

# zero-shot prompts ('{}' is the class name)
FASHION_MNIST_TEMPLATES = (
    "a photo of a {}.",
    "a black and white photo of a {}.",
    "a low resolution photo of a {}.",
    "a photo of the {}, a type of clothing.",
    "a product photo of a {}.",
)
