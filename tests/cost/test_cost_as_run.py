"""Layer measurements that already contain the layer's TP/SP collectives (timed as the runtime runs them)."""

import pytest
from cost_toys import toy_cluster, toy_model, toy_workload

from planner.cost import LayerMeasurement, module_cost
from planner.contract.strategy import ModuleStrategy

MODEL, CLUSTER, WORKLOAD = toy_model(), toy_cluster(8), toy_workload(global_batch=8)


class Measured:
    """Measures the given layers (0.1 s forward, 0.2 s backward), with or without their collectives inside."""

    def __init__(self, layers, *, includes_comm):
        self.layers, self.includes_comm = layers, includes_comm

    def layer_cost(self, *, layer, **kw):
        if layer.name not in self.layers:
            return None
        return LayerMeasurement(forward_s=0.1, backward_s=0.2, recompute_s=0.0, includes_comm=self.includes_comm)


def _cost(module, strategy, source):
    return module_cost(MODEL, module, CLUSTER, WORKLOAD, strategy, placement="colocated", precision="bf16_mixed",
                       first_rank=0, layer_costs=source)


def test_tp_collectives_inside_the_measurement_are_not_added_again():
    tp2 = ModuleStrategy(dp=4, tp=2, micro_batch=2)  # grad_accum = 8 / (4 * 2) = 1
    apart = _cost("llm", tp2, Measured({"decoder_layer"}, includes_comm=False))
    inside = _cost("llm", tp2, Measured({"decoder_layer"}, includes_comm=True))
    # A decoder layer's TP: 2 all-reduces forward + 2 backward of its output, 2 samples x 64 tokens x 128 hidden x
    # 2 B = 32768 B each; ring over 2 ranks on the toy NVLink (2e11 B/s x 0.8 bus efficiency, 10 us latency):
    # 32768 / 1.6e11 + 2 x 1e-5 s each; 2 decoder layers.
    all_reduce = 32768 / 1.6e11 + 2 * 1e-5
    assert apart.tp_comm_s - inside.tp_comm_s == pytest.approx(2 * 4 * all_reduce)
    assert inside.tp_comm_s > 0  # embedding and lm_head keep their analytical collectives
    assert inside.forward_s == apart.forward_s and inside.backward_s == apart.backward_s
    assert inside.sources["decoder_layer.tp_sp_collectives"] == "measured"
    assert "decoder_layer.tp_sp_collectives" not in apart.sources


def test_ulysses_all_to_all_inside_the_measurement_is_not_added_again():
    sp2 = ModuleStrategy(dp=4, sp=2, micro_batch=1)
    layers = {layer.name for layer in MODEL.module("vision").layers}
    assert _cost("vision", sp2, Measured(layers, includes_comm=False)).sp_comm_s > 0
    inside = _cost("vision", sp2, Measured(layers, includes_comm=True))
    assert inside.sp_comm_s == 0 and inside.tp_comm_s == 0
