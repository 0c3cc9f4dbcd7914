import sys, yaml, jax, jax.numpy as jnp
from kvjax import train
orig = train.init_params
scale = float(sys.argv[1])
def init(cfg, key, std=0.02):
    p = orig(cfg, key, std)
    c = std * scale * jax.random.normal(jax.random.PRNGKey(99), (cfg.hidden_size,))
    return {**p, "embed": p["embed"] + c}
train.init_params = init
c = yaml.safe_load(open('/tmp/ab/th10000.0.yaml'))
t = c['train']; t['steps'] = 400
t['curriculum'] = [[0, 32, 48, {"copy_random:64": 1}]]
yaml.safe_dump(c, open(f'/tmp/ab/sh{scale}.yaml', 'w'))
train.train(f'/tmp/ab/sh{scale}.yaml', f'/tmp/ab/runsh{scale}', export=None, log_every=50)
