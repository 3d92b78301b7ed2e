"""The TensorFlow runner's parts (runners/tensorflow.py): the cluster and devices, the Keras task,
its data by global position, the optimizer, the TF checkpoint, the export. Imported only by a
TensorFlow job's workers: nothing else in scaletrain imports TensorFlow."""
