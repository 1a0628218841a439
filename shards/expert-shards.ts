/**
 * Expert-parallel shards (experimental, format 'shoal-expert-shards/0'): a MoE checkpoint cut so
 * that a stage node runs attention and the router, and expert holders run the routed experts.
 * One graph per piece:
 *   embed.onnx            input_ids → hidden_states_out
 *   layer-N.onnx          dense layer N: the stage graph contract's layer (hidden_states, position_ids,
 *                         attention_mask, past → hidden_states_out, present)
 *                         MoE layer N: the same inputs → moe_base (the attention residual plus,
 *                         for Qwen2-MoE, the gated shared expert), moe_input (the post-attention
 *                         norm's rows), moe_experts (int64 top-k expert ids), moe_weights (f32
 *                         top-k weights, renormalised when the model says so), present
 *   layer-N/expert-E.onnx rows [m, D] → the expert's SwiGLU output [m, D] (what holders load)
 *   head.onnx             hidden_states, num_logits_to_keep → logits
 * The layer's output is moe_base + Σ weight · expert(moe_input) over each row's experts, which the
 * stage adds after combining the holders' partial sums (daemon/experts).
 */
import { existsSync } from 'node:fs'
import { copyFile, mkdir, writeFile } from 'node:fs/promises'
import { basename, join, resolve } from 'node:path'
import { normalizeConfig, type ModelSpec } from './architectures.ts'
import { checkpointHash, readConfig, readGenerationDefaults, TOKENIZER_FILES } from './checkpoint.ts'
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS,
  pastKeyName, pastValueName, presentKeyName, presentValueName, type GenerationDefaults, type ModelShape, type Quantization,
} from './contract.ts'
import { CheckpointError } from './errors.ts'
import { makeAttention, makeEmbedding, makeLayer, makeLmHead, makeNorm, makeSwiGlu, transpose } from './graph/blocks.ts'
import { DT, GraphBuilder } from './graph/builder.ts'
import { OP_TABLES } from './graph/ops.ts'
import type { BuildContext } from './graph/types.ts'
import { openWeights } from './safetensors.ts'
import { quantizationOf } from './quant.ts'

export const EXPERT_SHARDS_FORMAT = 'shoal-expert-shards/0'
export const MOE_BASE = 'moe_base'
export const MOE_INPUT = 'moe_input'
export const MOE_EXPERTS = 'moe_experts'
export const MOE_WEIGHTS = 'moe_weights'

export interface ExpertShardLayout {
  format: typeof EXPERT_SHARDS_FORMAT
  shape: ModelShape
  quantization: Quantization
  embed: string
  head: string
  /** Every layer in order; a MoE layer lists its experts' graphs (index = expert id). */
  layers: Array<{ layer: number, graph: string, experts?: string[] }>
  /**
   * What a node serving the model over the API needs (absent in layouts written before a daemon
   * served them): the model id, the checkpoint's content hash (so the layout's own hash names the
   * weights: holders and stages match on it), generation defaults and the copied tokenizer files.
   */
  modelId?: string
  sourceHash?: string
  generation?: GenerationDefaults
  tokenizerFiles?: string[]
}

async function writeGraph (outDir: string, path: string, g: GraphBuilder): Promise<string> {
  await mkdir(join(outDir, path, '..'), { recursive: true })
  await writeFile(join(outDir, path), g.encode(path, 'shoal expert-parallel piece'))
  await writeFile(join(outDir, `${path}.data`), Buffer.concat(g.data()))
  return path
}

const dataName = (path: string): string => `${path.split('/').pop()!}.data`

export interface ExpertShardOptions {
  modelDir: string
  outDir: string
  /** Every linear but the routers (always f32); int4 also the embedding — as in compileShards. */
  quant?: 'none' | 'int8' | 'int4'
  blockSize?: 32 | 128
  /** MatMulNBits accuracy_level: 0 f32 activations, 4 int8 (default, as compileShards). */
  accuracyLevel?: 0 | 4
  /** int4 only: the token embedding as 4-bit blocks (default) or f32, as compileShards. */
  embedding?: 'int4' | 'f32'
  /** Served model id (default: the checkpoint's shoal_model_id, else its directory name). */
  modelId?: string
}

export async function compileExpertShards (options: ExpertShardOptions): Promise<ExpertShardLayout> {
  const modelDir = resolve(options.modelDir)
  const outDir = resolve(options.outDir)
  const spec: ModelSpec = normalizeConfig(await readConfig(modelDir))
  const { shape } = spec
  const moe = shape.moe
  if (moe === undefined) throw new CheckpointError(`${modelDir}: not a mixture-of-experts model`)
  const w = await openWeights(modelDir)
  const ops = OP_TABLES.standard
  // compileShards' quantization, so expert-parallel and one-graph int4 pick the same tokens.
  const quant = quantizationOf(options, shape.hiddenSize)
  const context = (g: GraphBuilder): BuildContext => ({ g, spec, ops, quant, accuracyLevel: options.accuracyLevel ?? 4 })
  const { hiddenSize: D, numKvHeads: kvH, headDim: hd } = shape
  await mkdir(outDir, { recursive: true })

  const embedW = await w.get(spec.mapping.embedName)
  let g = new GraphBuilder(dataName('embed.onnx'))
  g.output(HIDDEN_OUT, makeEmbedding(context(g), g.input(INPUT_IDS, DT.INT64, ['batch_size', 'sequence_length']), embedW), DT.FLOAT, ['batch_size', 'sequence_length', D])
  const embed = await writeGraph(outDir, 'embed.onnx', g)

  const layers: ExpertShardLayout['layers'] = []
  for (let l = 0; l < shape.numLayers; l++) {
    const lw = await spec.mapping.layer(w, l)
    const path = `layer-${l}.onnx`
    g = new GraphBuilder(dataName(path))
    const ctx = context(g)
    const x = g.input(HIDDEN_IN, DT.FLOAT, ['batch_size', 'sequence_length', D])
    const tables = ops.stageTables(ctx, g.input(POSITION_IDS, DT.INT64, ['batch_size', 'sequence_length']), g.input(ATTENTION_MASK, DT.INT64, ['batch_size', 'total_sequence_length']), HIDDEN_IN)
    const pk = g.input(pastKeyName(l), DT.FLOAT, ['batch_size', kvH, 'past_sequence_length', hd])
    const pv = g.input(pastValueName(l), DT.FLOAT, ['batch_size', kvH, 'past_sequence_length', hd])
    const rows = ['batch_size', 'sequence_length']
    let presentK: string
    let presentV: string
    if (lw.moe === undefined) {
      const r = makeLayer(ctx, l, x, lw, tables, pk, pv)
      g.output(HIDDEN_OUT, r.out, DT.FLOAT, [...rows, D])
      presentK = r.presentK
      presentV = r.presentV
      layers.push({ layer: l, graph: path })
    } else {
      // makeLayer's first half, then the router; the experts run elsewhere.
      const n = `/model/layers.${l}`
      const h1 = makeNorm(ctx, `${n}/input_layernorm`, x, `model.layers.${l}.input_layernorm.weight`, lw.inputNorm)
      const attn = makeAttention(ctx, l, h1, lw, tables, pk, pv)
      const post = g.f32Weight(`model.layers.${l}.post_attention_layernorm.weight`, lw.postNorm.shape, lw.postNorm.data)
      const { sum, normed } = ops.addNorm(g, `${n}/post_attention_layernorm`, `${n}/attn_residual`, x, attn.out, post, shape.rmsNormEps)
      const m = `${n}/moe`
      const logits = g.op('MatMul', `${m}/router/MatMul`, [normed, g.f32Weight(`model.layers.${l}.moe.router.weight`, [D, moe.numExperts], transpose(lw.moe.router))])
      const probs = g.op('Softmax', `${m}/router/Softmax`, [logits], { axis: -1 })
      const [topP, topI] = g.node('TopK', `${m}/router/TopK`, [probs, g.i64([moe.topK])], { axis: -1, largest: 1, sorted: 1 }, 2) as [string, string]
      const weights = moe.normTopK
        ? g.op('Div', `${m}/router/norm/Div`, [topP, g.op('ReduceSum', `${m}/router/norm/ReduceSum`, [topP, g.i64([-1])], { keepdims: 1 })])
        : topP
      let base = sum
      if (lw.moe.shared !== undefined) {
        const sh = makeSwiGlu(ctx, `${m}/shared_expert`, `model.layers.${l}.moe.shared_expert`, normed, lw.moe.shared, moe.sharedExpertIntermediateSize)
        const gate = g.op('Sigmoid', `${m}/shared_expert_gate/Sigmoid`, [g.op('MatMul', `${m}/shared_expert_gate/MatMul`, [normed, g.f32Weight(`model.layers.${l}.moe.shared_expert_gate.weight`, [D, 1], lw.moe.shared.gate.data)])])
        base = g.op('Add', `${m}/shared_expert/gated/Add`, [sum, g.op('Mul', `${m}/shared_expert/gated/Mul`, [sh, gate])])
      }
      g.output(MOE_BASE, base, DT.FLOAT, [...rows, D])
      g.output(MOE_INPUT, normed, DT.FLOAT, [...rows, D])
      g.output(MOE_EXPERTS, topI, DT.INT64, [...rows, moe.topK])
      g.output(MOE_WEIGHTS, weights, DT.FLOAT, [...rows, moe.topK])
      presentK = attn.presentK
      presentV = attn.presentV
      const experts: string[] = []
      for (const [e, ew] of lw.moe.experts.entries()) {
        const ep = `layer-${l}/expert-${e}.onnx`
        const eg = new GraphBuilder(dataName(ep))
        const y = makeSwiGlu(context(eg), `/model/layers.${l}/moe/experts.${e}`, `model.layers.${l}.moe.experts.${e}`, eg.input('rows', DT.FLOAT, ['rows', D]), ew, moe.expertIntermediateSize)
        eg.output('out', y, DT.FLOAT, ['rows', D])
        experts.push(await writeGraph(outDir, ep, eg))
      }
      layers.push({ layer: l, graph: path, experts })
    }
    g.output(presentKeyName(l), presentK, DT.FLOAT, ['batch_size', kvH, 'total_sequence_length', hd])
    g.output(presentValueName(l), presentV, DT.FLOAT, ['batch_size', kvH, 'total_sequence_length', hd])
    await writeGraph(outDir, path, g)
  }

  g = new GraphBuilder(dataName('head.onnx'))
  const tied = shape.tieWordEmbeddings || !w.has(spec.mapping.lmHeadName)
  const headW = tied ? embedW : await w.get(spec.mapping.lmHeadName)
  // A tied head is quantized from the embedding, as compileShards does.
  const logits = makeLmHead(context(g), g.input(HIDDEN_IN, DT.FLOAT, ['batch_size', 'sequence_length', D]), g.input(NUM_LOGITS_TO_KEEP, DT.INT64, []), await w.get(spec.mapping.finalNormName), headW, 'lm_head.weight', false)
  g.output(LOGITS, logits, DT.FLOAT, ['batch_size', 'logits_to_keep', shape.vocabSize])
  const head = await writeGraph(outDir, 'head.onnx', g)

  const tokenizerFiles: string[] = []
  for (const f of TOKENIZER_FILES) {
    if (!existsSync(join(modelDir, f))) continue
    await copyFile(join(modelDir, f), join(outDir, f))
    tokenizerFiles.push(f)
  }
  const config = await readConfig(modelDir)
  const layout: ExpertShardLayout = {
    format: EXPERT_SHARDS_FORMAT, shape, quantization: quant, embed, head, layers,
    modelId: options.modelId ?? (typeof config.shoal_model_id === 'string' ? config.shoal_model_id : basename(modelDir)),
    sourceHash: await checkpointHash(modelDir),
    generation: await readGenerationDefaults(modelDir, config),
    tokenizerFiles,
  }
  await writeFile(join(outDir, 'layout.json'), JSON.stringify(layout, null, 2) + '\n')
  return layout
}
