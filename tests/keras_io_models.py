"""Models of keras-team/keras-io that customise ``fit``, shared by the tests that train and
diagnose them (imported by those test modules, not collected itself). Each names its file."""

from __future__ import annotations

import keras
import tensorflow as tf


class GuideModel(keras.Model):
    """guides/custom_train_step_in_tensorflow.py, "A first simple example": ``compute_loss`` and
    ``optimizer.apply``, the metrics updated by hand (no ``scale_loss``)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}
