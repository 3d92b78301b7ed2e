"""The TensorFlow runner's parts (runners/tensorflow.py): the cluster and devices, the data by
global position, the optimizer, the TF checkpoint, the export. Imported only by a
TensorFlow job's workers; TensorFlow itself only there, in keras_task.py (the task a user writes)
and plan/keras_profile.py, never in a PyTorch job."""
