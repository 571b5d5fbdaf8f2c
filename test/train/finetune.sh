#!/usr/bin/env bash
# Task heads end to end on real proteins (mmseqs2's example DB; exit 77 = skipped without it):
# `plm prep --labels / --residue-labels`, `plm train` with task.kind set on a small random
# encoder (2 layers, hidden 64), and the held-out metrics against the trivial baseline
# the eval record carries (predict the held-out mean / the majority class).  Labels are computed
# from the sequence: the fraction of hydrophobic residues AILMFVW (regression), the sign of the
# net charge K+R-D-E (classification), the residue class hydrophobic/polar/charged (tokens).
# Margins (observed values in brackets, at 40 steps): regression MSE < 0.95 x baseline and
# Spearman > 0.4 [0.85 x, 0.66]; token accuracy > baseline + 0.3 [0.95 vs 0.39]; charge-sign
# AUROC > 0.65 [0.77].  Two ranks train the regression head to the one-rank result within
# fp32 tolerance.  The encoder trained through the head (task.freeze_encoder: false): its
# weights change, the training loss falls 10x, the held-out MSE < 0.8 x the frozen run's
# [0.49 x]; on 2 ranks, plain and sharded, within 1e-3 of one rank [4e-8].  `plm eval --head`
# against the runs' own evaluations; the head through Hugging Face and back.  Then the
# refusals, each naming what is wrong.
# usage: finetune.sh PLM MPIEXEC WORKDIR
set -u
plm=$1 mpiexec=$2 work=$3
db=/usr/share/doc/mmseqs2/example-data/DB.fasta.gz
[ -r "$db" ] || { echo "skipped: $db not found"; exit 77; }
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
zcat "$db" | awk '/^>/{n++} n<=1200' > s.fa
awk 'BEGIN{print "id,label" > "reg.csv"; print "id,label" > "cls.csv"}
     function flush() { if (id == "") return; h = 0; q = 0; lab = "";
       for (i = 1; i <= length(seq); i++) { c = substr(seq, i, 1);
         if (index("AILMFVW", c)) h++; if (index("KR", c)) q++; if (index("DE", c)) q--;
         lab = lab (index("AILMFVWC", c) ? "0" : (index("DEKR", c) ? "2" : "1")) }
       printf "%s,%.6f\n", id, h / length(seq) >> "reg.csv";
       printf "%s,%d\n", id, (q > 0) >> "cls.csv"; printf ">%s\n%s\n", id, lab >> "res.fa" }
     /^>/ { flush(); id = substr($1, 2); seq = ""; next } { seq = seq $0 } END { flush() }' s.fa
"$plm" prep s.fa --out d --labels reg.csv --residue-labels res.fa --valid-fraction 0.2 > prep.log 2>&1 ||
  fail "prep: $(cat prep.log)"
"$plm" prep s.fa --out dc --labels cls.csv --valid-fraction 0.2 > prepc.log 2>&1 ||
  fail "prep: $(cat prepc.log)"
cat > deck.yaml <<'DECK'
model:
  preset: custom
  layers: 2
  hidden: 64
  heads: 4
  ffn: 128
data:
  train: d/train.h5
  valid: d/valid.h5
  tokens_per_batch: 16384
  micro_batch_tokens: 8192
  max_seq_len: 256
train:
  steps: 40
  log_every: 10
  eval_every: 0
  run_dir: run
schedule:
  warmup_steps: 2
checkpoint:
  every: 0
  resume: none
task:
  kind: sequence_regression
  head_lr: 0.003
DECK
# field NAME of the last task_eval record of RUN/metrics.jsonl
field() { grep '"task_eval"' "$1/metrics.jsonl" | tail -1 | sed -E "s/.*\"$2\":([-0-9.eE+]+).*/\\1/"; }
check() { awk -v a="$1" -v b="$2" "BEGIN{exit !($3)}" || fail "$4: $1 vs $2"; }

"$plm" train deck.yaml > r1.log 2>&1 || fail "regression: $(tail -5 r1.log)"
mse=$(field run mse) base=$(field run baseline_mse) rho=$(field run spearman)
echo "regression: mse $mse baseline $base spearman $rho"
check "$mse" "$base" "a < 0.95 * b" "regression MSE not below 0.95 x the mean-predicting baseline"
check "$rho" 0.4 "a > b" "regression Spearman"
[ -s run/head.h5 ] || fail "run/head.h5 not written"

"$mpiexec" -n 2 --oversubscribe --bind-to none "$plm" train deck.yaml --set train.run_dir=run_np2 \
  > r2.log 2>&1 || fail "regression on 2 ranks: $(tail -5 r2.log)"
mse2=$(field run_np2 mse)
echo "regression on 2 ranks: mse $mse2"
check "$mse2" "$mse" "a - b < 1e-4 * b && b - a < 1e-4 * b" "2 ranks differ from 1 rank"

# The encoder trained through the head (task.freeze_encoder: false; the encoder at optimizer.lr,
# the head at task.head_lr): its weights change, the training loss falls, the held-out MSE beats
# the baseline; `plm eval --head` of the result gives the run's own last evaluation; sharded
# data parallelism on 2 ranks trains the same model.
"$plm" train deck.yaml --set task.freeze_encoder=false --set optimizer.lr=0.0003 \
  --set train.log_every=1 --set train.run_dir=run_ft > r5.log 2>&1 || fail "trainable encoder: $(tail -5 r5.log)"
loss1=$(grep '"task_step"' run_ft/metrics.jsonl | head -1 | sed -E 's/.*"loss":([-0-9.eE+]+).*/\1/')
loss2=$(grep '"task_step"' run_ft/metrics.jsonl | tail -1 | sed -E 's/.*"loss":([-0-9.eE+]+).*/\1/')
msef=$(field run_ft mse) base=$(field run_ft baseline_mse)
echo "trainable encoder: training loss $loss1 -> $loss2, held-out mse $msef baseline $base"
check "$loss2" "$loss1" "a < 0.1 * b" "trainable encoder: the training loss did not fall"
check "$msef" "$base" "a < 0.95 * b" "trainable encoder: MSE not below 0.95 x the baseline"
check "$msef" "$mse" "a < 0.8 * b" "trainable encoder: MSE not below 0.8 x the frozen encoder's"
# LoRA adapters with the head (doc/finetune.md): only the adapters and the head train.
"$plm" train deck.yaml --set task.freeze_encoder=false --set optimizer.lr=0.001 --set lora.rank=4 \
  --set lora.alpha=8 --set train.run_dir=run_lora > r8.log 2>&1 || fail "LoRA with a head: $(tail -5 r8.log)"
grep -q "adapter parameters train, the [0-9]* of the base model are frozen" r8.log ||
  fail "LoRA with a head: no frozen-base line"
msel=$(field run_lora mse) base=$(field run_lora baseline_mse)
echo "LoRA rank 4 with the head: mse $msel baseline $base"
check "$msel" "$base" "a < 0.95 * b" "LoRA with a head: MSE not below 0.95 x the baseline"
"$plm" convert --to-hf run/model.h5 --out hf_frozen > c1.log 2>&1 || fail "$(cat c1.log)"
"$plm" convert --to-hf run_ft/model.h5 --out hf_ft > c2.log 2>&1 || fail "$(cat c2.log)"
cmp -s hf_frozen/model.safetensors hf_ft/model.safetensors &&
  fail "trainable encoder: the encoder weights did not change"
"$plm" eval deck.yaml --model run_ft/model.h5 --head run_ft/head.h5 > e1.log 2>&1 ||
  fail "eval --head: $(tail -5 e1.log)"
msee=$(grep -o 'task eval .* mse [-0-9.eE+]*' e1.log | sed -E 's/.* mse //')
echo "plm eval --head: mse $msee (the run's last evaluation: $msef)"
check "$msee" "$msef" "a - b < 1e-3 * b && b - a < 1e-3 * b" "plm eval --head differs from the run"
"$mpiexec" -n 2 --oversubscribe --bind-to none "$plm" train deck.yaml --set task.freeze_encoder=false \
  --set optimizer.lr=0.0003 --set parallel.shard_degree=2 --set train.run_dir=run_ft_fsdp \
  > r6.log 2>&1 || fail "trainable encoder, sharded on 2 ranks: $(tail -5 r6.log)"
msef2=$(field run_ft_fsdp mse)
echo "trainable encoder, sharded on 2 ranks: mse $msef2"
check "$msef2" "$msef" "a - b < 1e-3 * b && b - a < 1e-3 * b" "sharded 2 ranks differ from 1 rank"
"$mpiexec" -n 2 --oversubscribe --bind-to none "$plm" train deck.yaml --set task.freeze_encoder=false \
  --set optimizer.lr=0.0003 --set train.run_dir=run_ft_np2 > r7.log 2>&1 ||
  fail "trainable encoder on 2 ranks: $(tail -5 r7.log)"
msef3=$(field run_ft_np2 mse)
echo "trainable encoder, data parallel on 2 ranks: mse $msef3"
check "$msef3" "$msef" "a - b < 1e-3 * b && b - a < 1e-3 * b" "2 ranks differ from 1 rank"

"$plm" train deck.yaml --set task.kind=token_classification --set task.num_labels=3 \
  --set train.run_dir=run_tok > r3.log 2>&1 || fail "token: $(tail -5 r3.log)"
acc=$(field run_tok accuracy) base=$(field run_tok baseline_accuracy)
echo "token classification: accuracy $acc baseline $base"
check "$acc" "$base" "a > b + 0.3" "token accuracy not 0.3 above the majority class"

"$plm" train deck.yaml --set task.kind=sequence_classification --set task.num_labels=2 \
  --set task.pooling=mean --set data.train=dc/train.h5 --set data.valid=dc/valid.h5 \
  --set train.run_dir=run_cls > r4.log 2>&1 || fail "classification: $(tail -5 r4.log)"
auc=$(field run_cls auroc)
echo "sequence classification: auroc $auc accuracy $(field run_cls accuracy)"
check "$auc" 0.65 "a > b" "charge-sign AUROC"

# Export: the head joins the Hugging Face folder as EsmForSequenceClassification.
"$plm" convert --to-hf run/model.h5 --head run/head.h5 --out hf > conv.log 2>&1 ||
  fail "convert --head: $(cat conv.log)"
grep -q '"EsmForSequenceClassification"' hf/config.json || fail "config.json architectures"
grep -q '"problem_type": "regression"' hf/config.json || fail "config.json problem_type"
for t in classifier.dense.weight classifier.dense.bias classifier.out_proj.weight \
  classifier.out_proj.bias; do
  head -c 100000 hf/model.safetensors | grep -aq "\"$t\"" || fail "$t not in model.safetensors"
done

# Back from Hugging Face with the head: --from-hf stores it in the model file (/head), --to-hf
# of that file exports the same folder byte for byte, and `plm eval --head` of it gives the
# run's evaluation.  A folder as transformers saves EsmForSequenceClassification (no LM head:
# the lm_head.* tensors dropped here with plain Python, the safetensors layout being a JSON
# header and raw bytes) converts too, its LM head written untrained, its head and encoder kept.
"$plm" convert --from-hf hf --out back.h5 > conv2.log 2>&1 || fail "from-hf head: $(cat conv2.log)"
grep -q "sequence_regression head" conv2.log || fail "from-hf does not state the head: $(cat conv2.log)"
"$plm" convert --to-hf back.h5 --out hf2 > conv3.log 2>&1 || fail "to-hf of back.h5: $(cat conv3.log)"
cmp -s hf/model.safetensors hf2/model.safetensors || fail "plm -> HF -> plm -> HF weights differ"
cmp -s hf/config.json hf2/config.json || fail "plm -> HF -> plm -> HF config.json differs"
python3 - hf hf_nolm <<'PY' || fail "could not write the LM-head-free folder"
import json, os, shutil, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
shutil.copy(os.path.join(src, "config.json"), dst)
raw = open(os.path.join(src, "model.safetensors"), "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
out, blobs, at = {}, [], 0
for name, t in header.items():
    if name == "__metadata__" or name.startswith("lm_head."):
        continue
    a, b = t["data_offsets"]
    out[name] = dict(t, data_offsets=[at, at + b - a])
    blobs.append(body[a:b])
    at += b - a
text = json.dumps(out).encode()
text += b" " * (-len(text) % 8)
with open(os.path.join(dst, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
PY
"$plm" convert --from-hf hf_nolm --out nolm.h5 > conv4.log 2>&1 || fail "from-hf without LM head: $(cat conv4.log)"
grep -q "no LM head" conv4.log || fail "from-hf without an LM head does not say so: $(cat conv4.log)"
for m in back.h5 nolm.h5; do
  "$plm" eval deck.yaml --model $m --head $m > e_$m.log 2>&1 || fail "eval --head $m: $(tail -5 e_$m.log)"
  msem=$(grep -o 'task eval .* mse [-0-9.eE+]*' e_$m.log | sed -E 's/.* mse //')
  echo "plm eval --head of $m: mse $msem (the run: $mse)"
  check "$msem" "$mse" "a - b < 1e-5 * b && b - a < 1e-5 * b" "eval --head of $m differs from the run"
done

# Refusals: each must fail and name the culprit.
refuse() {  # EXPECTED-TEXT COMMAND...
  local want=$1; shift
  "$@" > refuse.log 2>&1 && fail "accepted: $*"
  grep -q -- "$want" refuse.log || fail "message of '$*' lacks '$want': $(cat refuse.log)"
}
id=$(awk -F, 'NR==3{print $1}' reg.csv)
grep -v "^$id," reg.csv > missing.csv
refuse "record \`$id\` has no row in --labels" "$plm" prep s.fa --out x --labels missing.csv
awk -v id="$id" '/^>/{p = ($0 == ">" id)} {if (p && !/^>/) print $0 "0"; else print}' res.fa > long.fa
refuse "record \`$id\`: " "$plm" prep s.fa --out x --residue-labels long.fa
refuse "has no per-residue labels" "$plm" train deck.yaml --set task.kind=token_classification \
  --set task.num_labels=3 --set data.train=dc/train.h5 --set data.valid=dc/valid.h5
refuse "has label 0.3" "$plm" train deck.yaml --set task.kind=sequence_classification \
  --set task.num_labels=2
refuse "task.num_labels" "$plm" train deck.yaml --set task.num_labels=2
refuse "mean-pooled head cannot be exported" "$plm" convert --to-hf run_cls/model.h5 \
  --head run_cls/head.h5 --out hf_mean
echo "all fine-tuning checks passed"
