"""A hand-written MultiWorkerMirroredStrategy script: the digits MLP of examples/digits_keras.py,
the way the TensorFlow guide writes a custom loop (Keras 3's model.fit fails under this strategy
here). Start one process per worker with TF_CONFIG set; worker 0 prints one JSON line:
first_step_at (wall clock) and the steady step time (median over windows of 20 steps from
step 100 on).

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:PORT0", "127.0.0.1:PORT1"]}, "task": {"type": "worker", "index": I}}' \\
        python bench/baselines/mwms_digits.py --steps 600
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--batch-size", type=int, default=32)  # per worker
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
tf.config.threading.set_intra_op_parallelism_threads(args.threads)
tf.config.threading.set_inter_op_parallelism_threads(min(2, args.threads))
strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(0)
images, labels = load_digits(return_X_y=True)
x, y = (images / 16.0).astype("float32"), labels.astype("int64")
order = np.random.default_rng(1234).permutation(len(x))
train = (x[order[359:]], y[order[359:]])
workers = strategy.num_replicas_in_sync
global_batch = args.batch_size * workers
dataset = (tf.data.Dataset.from_tensor_slices(train).shuffle(len(train[0]), seed=0).repeat()
           .batch(global_batch, drop_remainder=True))
batches = iter(strategy.experimental_distribute_dataset(dataset))
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="gelu"), keras.layers.Dropout(0.1),
        keras.layers.Dense(128, activation="gelu"), keras.layers.Dropout(0.1),
        keras.layers.Dense(10),
    ])
    optimizer = keras.optimizers.AdamW(learning_rate=3e-3, weight_decay=0.01)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


@tf.function
def train_step(inputs):
    def step_fn(features, targets):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(targets, model(features, training=True)),
                                              global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return strategy.reduce("SUM", strategy.run(step_fn, args=inputs), axis=None)


first_step_at, windows, window_start = None, [], None
for step in range(1, args.steps + 1):
    loss = train_step(next(batches))
    if step == 1:
        loss.numpy()
        first_step_at = time.time()
    if step >= 100 and step % 20 == 0:
        loss.numpy()
        now = time.perf_counter()
        if window_start is not None:
            windows.append((now - window_start) / 20)
        window_start = now
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
    print(json.dumps({"first_step_at": first_step_at, "step_time_s": statistics.median(windows),
                      "loss": float(loss)}), flush=True)
