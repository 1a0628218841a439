/**
 * A float64 reference forward pass for the supported decoder families (dense, and the
 * mixture-of-experts ones: Mixtral, Qwen2-MoE, Qwen3-MoE), in plain TypeScript.
 * Tests only. It reads config.json and the safetensors files itself and shares no code with the
 * shard compiler or graph builder, so agreement between the two is evidence, not tautology.
 */
import { existsSync, readFileSync } from 'node:fs'
import { join } from 'node:path'

type Vec = Float64Array

interface RefLayer {
  inNorm: Vec
  postNorm: Vec
  q: Vec; k: Vec; v: Vec // [out, in]
  qb?: Vec; kb?: Vec; vb?: Vec
  qNorm?: Vec; kNorm?: Vec
  o: Vec
  gate?: Vec; up?: Vec; down?: Vec
  moe?: RefMoe
}

interface RefMlp { gate: Vec, up: Vec, down: Vec, I: number }

interface RefMoe {
  router: Vec // [E, D]
  experts: RefMlp[]
  shared?: RefMlp & { sgate: Vec }
}

/** Which experts a MoE layer chose for one token, and their weights (for router tests). */
export interface RefRoute { layer: number, experts: number[], weights: number[] }

function half (h: number, bf16: boolean): number {
  if (bf16) { const b = new DataView(new ArrayBuffer(4)); b.setUint32(0, h << 16); return b.getFloat32(0) }
  const s = h & 0x8000 ? -1 : 1
  const e = (h >> 10) & 0x1f
  const m = h & 0x3ff
  if (e === 0) return s * m * 2 ** -24
  if (e === 31) return m ? NaN : s * Infinity
  return s * (1 + m / 1024) * 2 ** (e - 15)
}

function loadTensors (dir: string): Map<string, { shape: number[], data: Vec }> {
  const files = existsSync(join(dir, 'model.safetensors.index.json'))
    ? [...new Set(Object.values((JSON.parse(readFileSync(join(dir, 'model.safetensors.index.json'), 'utf8')) as { weight_map: Record<string, string> }).weight_map))]
    : ['model.safetensors']
  const out = new Map<string, { shape: number[], data: Vec }>()
  for (const f of files) {
    const buf = readFileSync(join(dir, f))
    const n = Number(buf.readBigUInt64LE(0))
    const header = JSON.parse(buf.subarray(8, 8 + n).toString('utf8')) as Record<string, { dtype: string, shape: number[], data_offsets: [number, number] }>
    for (const [name, e] of Object.entries(header)) {
      if (name === '__metadata__') continue
      const start = 8 + n + e.data_offsets[0]
      const count = e.shape.reduce((a, b) => a * b, 1)
      const data = new Float64Array(count)
      for (let i = 0; i < count; i++) {
        data[i] = e.dtype === 'F32' ? buf.readFloatLE(start + 4 * i) : half(buf.readUInt16LE(start + 2 * i), e.dtype === 'BF16')
      }
      out.set(name, { shape: e.shape, data })
    }
  }
  return out
}

function matvec (w: Vec, x: Vec, rows: number, bias?: Vec): Vec {
  const cols = x.length
  const y = new Float64Array(rows)
  for (let r = 0; r < rows; r++) {
    let s = bias?.[r] ?? 0
    const base = r * cols
    for (let c = 0; c < cols; c++) s += w[base + c]! * x[c]!
    y[r] = s
  }
  return y
}

function rmsNorm (x: Vec, w: Vec, eps: number): Vec {
  let ss = 0
  for (const v of x) ss += v * v
  const inv = 1 / Math.sqrt(ss / x.length + eps)
  return x.map((v, i) => v * inv * w[i]!)
}

/**
 * HF rope (modeling_rope_utils): default, linear, llama3, yarn, longrope. Returns the inverse
 * frequencies per position (LongRoPE: the long factors from original_max_position_embeddings on,
 * per position — the rule shards/rope.ts documents) and HF's attention_scaling on cos/sin.
 */
function ropeOf (cfg: Record<string, any>, hd: number): { at: (pos: number) => number[], scale: number } {
  const theta = cfg.rope_theta ?? 10000
  const dimPow = (i: number): number => theta ** ((2 * i) / hd)
  let inv = Array.from({ length: hd / 2 }, (_, i) => 1 / dimPow(i))
  const rs = cfg.rope_scaling
  const type = rs?.rope_type ?? rs?.type
  if (type === 'linear') inv = inv.map(f => f / rs.factor)
  else if (type === 'llama3') {
    const { factor, low_freq_factor: lo, high_freq_factor: hi, original_max_position_embeddings: old } = rs
    inv = inv.map(f => {
      const wl = 2 * Math.PI / f
      if (wl < old / hi) return f
      if (wl > old / lo) return f / factor
      const sm = (old / wl - lo) / (hi - lo)
      return (1 - sm) * f / factor + sm * f
    })
  } else if (type === 'yarn') {
    const orig: number = rs.original_max_position_embeddings ?? cfg.max_position_embeddings
    const factor: number = rs.factor ?? cfg.max_position_embeddings / orig
    const ms = (s: number, m = 1): number => s <= 1 ? 1 : 0.1 * m * Math.log(s) + 1
    const scale: number = rs.attention_factor ?? (rs.mscale && rs.mscale_all_dim ? ms(factor, rs.mscale) / ms(factor, rs.mscale_all_dim) : ms(factor))
    const dimFor = (rot: number): number => hd * Math.log(orig / (rot * 2 * Math.PI)) / (2 * Math.log(theta))
    let lo = dimFor(rs.beta_fast || 32)
    let hi = dimFor(rs.beta_slow || 1)
    if (rs.truncate !== false) { lo = Math.floor(lo); hi = Math.ceil(hi) }
    lo = Math.max(lo, 0); hi = Math.min(hi, hd - 1)
    if (lo === hi) hi += 0.001
    const yarnInv = inv.map((f, i) => {
      const extra = 1 - Math.min(1, Math.max(0, (i - lo) / (hi - lo)))
      return (1 / (factor * dimPow(i))) * (1 - extra) + f * extra
    })
    return { at: () => yarnInv, scale }
  } else if (type === 'longrope') {
    let orig: number
    let factor: number
    if (cfg.original_max_position_embeddings !== undefined) {
      orig = cfg.original_max_position_embeddings
      factor = cfg.max_position_embeddings / orig
    } else if (rs.original_max_position_embeddings !== undefined) {
      orig = rs.original_max_position_embeddings
      factor = rs.factor ?? cfg.max_position_embeddings / orig
    } else {
      orig = cfg.max_position_embeddings
      factor = rs.factor ?? 1
    }
    const scale: number = rs.attention_factor ?? (factor <= 1 ? 1 : Math.sqrt(1 + Math.log(factor) / Math.log(orig)))
    const short = (rs.short_factor as number[]).map((e, i) => 1 / (e * dimPow(i)))
    const long = (rs.long_factor as number[]).map((e, i) => 1 / (e * dimPow(i)))
    return { at: (pos) => pos >= orig ? long : short, scale }
  } else if (type !== undefined && type !== 'default') throw new Error(`reference: rope ${type}`)
  return { at: () => inv, scale: 1 }
}

export interface RefCache {
  keys: Vec[][][] // [layer][kvHead][pos] → hd
  values: Vec[][][]
}

export class ReferenceModel {
  readonly cfg: Record<string, any>
  readonly D: number; readonly H: number; readonly kvH: number; readonly hd: number; readonly I: number; readonly V: number; readonly L: number
  private readonly layers: RefLayer[]
  private readonly embed: Vec
  private readonly head: Vec
  private readonly norm: Vec
  private readonly rotary: { at: (pos: number) => number[], scale: number }
  private readonly eps: number

  constructor (dir: string) {
    const cfg = JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')) as Record<string, any>
    this.cfg = cfg
    const t = loadTensors(dir)
    const get = (n: string): Vec => { const x = t.get(n); if (x === undefined) throw new Error(`reference: missing ${n}`); return x.data }
    this.D = cfg.hidden_size; this.H = cfg.num_attention_heads; this.kvH = cfg.num_key_value_heads ?? this.H
    this.hd = cfg.head_dim ?? this.D / this.H; this.I = cfg.intermediate_size; this.V = cfg.vocab_size; this.L = cfg.num_hidden_layers
    this.eps = cfg.rms_norm_eps
    this.embed = get('model.embed_tokens.weight')
    this.head = cfg.tie_word_embeddings === true ? this.embed : get('lm_head.weight')
    this.norm = get('model.norm.weight')
    this.rotary = ropeOf(cfg, this.hd)
    const qn = this.H * this.hd
    const kn = this.kvH * this.hd
    this.layers = []
    for (let l = 0; l < this.L; l++) {
      const p = `model.layers.${l}`
      const common = { inNorm: get(`${p}.input_layernorm.weight`), postNorm: get(`${p}.post_attention_layernorm.weight`), o: get(`${p}.self_attn.o_proj.weight`) }
      const mt = cfg.model_type as string
      if (['mixtral', 'qwen2_moe', 'qwen3_moe'].includes(mt)) {
        const a = `${p}.self_attn`
        const layer: RefLayer = { ...common, q: get(`${a}.q_proj.weight`), k: get(`${a}.k_proj.weight`), v: get(`${a}.v_proj.weight`) }
        if (mt === 'qwen2_moe') { layer.qb = get(`${a}.q_proj.bias`); layer.kb = get(`${a}.k_proj.bias`); layer.vb = get(`${a}.v_proj.bias`) }
        if (mt === 'qwen3_moe') { layer.qNorm = get(`${a}.q_norm.weight`); layer.kNorm = get(`${a}.k_norm.weight`) }
        // HF's rule: Mixtral is MoE everywhere; Qwen-MoE unless in mlp_only_layers or off the sparse step.
        const isMoe = mt === 'mixtral' || (!(cfg.mlp_only_layers ?? []).includes(l) && cfg.num_experts > 0 && (l + 1) % (cfg.decoder_sparse_step ?? 1) === 0)
        if (!isMoe) {
          layer.gate = get(`${p}.mlp.gate_proj.weight`); layer.up = get(`${p}.mlp.up_proj.weight`); layer.down = get(`${p}.mlp.down_proj.weight`)
        } else if (mt === 'mixtral') {
          const b = `${p}.block_sparse_moe`
          layer.moe = {
            router: get(`${b}.gate.weight`),
            experts: Array.from({ length: cfg.num_local_experts as number }, (_, e) => ({ gate: get(`${b}.experts.${e}.w1.weight`), up: get(`${b}.experts.${e}.w3.weight`), down: get(`${b}.experts.${e}.w2.weight`), I: this.I })),
          }
        } else {
          const b = `${p}.mlp`
          const I = cfg.moe_intermediate_size as number
          layer.moe = {
            router: get(`${b}.gate.weight`),
            experts: Array.from({ length: cfg.num_experts as number }, (_, e) => ({ gate: get(`${b}.experts.${e}.gate_proj.weight`), up: get(`${b}.experts.${e}.up_proj.weight`), down: get(`${b}.experts.${e}.down_proj.weight`), I })),
          }
          if (mt === 'qwen2_moe' && (cfg.shared_expert_intermediate_size ?? 0) > 0) {
            const sh = `${b}.shared_expert`
            layer.moe.shared = { gate: get(`${sh}.gate_proj.weight`), up: get(`${sh}.up_proj.weight`), down: get(`${sh}.down_proj.weight`), I: cfg.shared_expert_intermediate_size, sgate: get(`${b}.shared_expert_gate.weight`) }
          }
        }
        this.layers.push(layer)
        continue
      }
      const down = get(`${p}.mlp.down_proj.weight`)
      if (cfg.model_type === 'phi3') {
        const qkv = get(`${p}.self_attn.qkv_proj.weight`)
        const gu = get(`${p}.mlp.gate_up_proj.weight`)
        this.layers.push({
          ...common,
          q: qkv.slice(0, qn * this.D), k: qkv.slice(qn * this.D, (qn + kn) * this.D), v: qkv.slice((qn + kn) * this.D),
          gate: gu.slice(0, this.I * this.D), up: gu.slice(this.I * this.D), down,
        })
      } else {
        const a = `${p}.self_attn`
        const layer: RefLayer = {
          ...common,
          q: get(`${a}.q_proj.weight`), k: get(`${a}.k_proj.weight`), v: get(`${a}.v_proj.weight`),
          gate: get(`${p}.mlp.gate_proj.weight`), up: get(`${p}.mlp.up_proj.weight`), down,
        }
        if (cfg.model_type === 'qwen2') { layer.qb = get(`${a}.q_proj.bias`); layer.kb = get(`${a}.k_proj.bias`); layer.vb = get(`${a}.v_proj.bias`) }
        if (cfg.model_type === 'qwen3') { layer.qNorm = get(`${a}.q_norm.weight`); layer.kNorm = get(`${a}.k_norm.weight`) }
        this.layers.push(layer)
      }
    }
  }

  newCache (): RefCache {
    const mk = (): Vec[][][] => Array.from({ length: this.L }, () => Array.from({ length: this.kvH }, () => []))
    return { keys: mk(), values: mk() }
  }

  private rope (x: Vec, pos: number): Vec {
    const h = this.hd / 2
    const out = new Float64Array(this.hd)
    const inv = this.rotary.at(pos)
    const sc = this.rotary.scale
    for (let i = 0; i < h; i++) {
      const a = pos * inv[i]!
      const c = Math.cos(a) * sc
      const s = Math.sin(a) * sc
      out[i] = x[i]! * c - x[i + h]! * s
      out[i + h] = x[i + h]! * c + x[i]! * s
    }
    return out
  }

  /** Runs one token at position `pos` (= cache length) and returns its logits. */
  step (token: number, cache: RefCache): Vec {
    const { D, H, kvH, hd } = this
    const pos = cache.keys[0]![0]!.length
    let x = this.embed.slice(token * D, (token + 1) * D)
    for (let l = 0; l < this.L; l++) {
      const w = this.layers[l]!
      const hN = rmsNorm(x, w.inNorm, this.eps)
      const q = matvec(w.q, hN, H * hd, w.qb)
      const k = matvec(w.k, hN, kvH * hd, w.kb)
      const v = matvec(w.v, hN, kvH * hd, w.vb)
      for (let g = 0; g < kvH; g++) {
        let kh: Vec = k.slice(g * hd, (g + 1) * hd)
        if (w.kNorm !== undefined) kh = rmsNorm(kh, w.kNorm, this.eps)
        cache.keys[l]![g]!.push(this.rope(kh, pos))
        cache.values[l]![g]!.push(v.slice(g * hd, (g + 1) * hd))
      }
      const attn = new Float64Array(H * hd)
      for (let h = 0; h < H; h++) {
        let qh: Vec = q.slice(h * hd, (h + 1) * hd)
        if (w.qNorm !== undefined) qh = rmsNorm(qh, w.qNorm, this.eps)
        qh = this.rope(qh, pos)
        const g = Math.floor(h / (H / kvH))
        const keys = cache.keys[l]![g]!
        const scores = keys.map(kv => { let s = 0; for (let i = 0; i < hd; i++) s += qh[i]! * kv[i]!; return s / Math.sqrt(hd) })
        const m = Math.max(...scores)
        const e = scores.map(s => Math.exp(s - m))
        const z = e.reduce((a, b) => a + b, 0)
        const vals = cache.values[l]![g]!
        for (let j = 0; j < keys.length; j++) for (let i = 0; i < hd; i++) attn[h * hd + i]! += (e[j]! / z) * vals[j]![i]!
      }
      const o = matvec(w.o, attn, D)
      x = x.map((xi, i) => xi + o[i]!)
      const m = rmsNorm(x, w.postNorm, this.eps)
      const dn = w.moe !== undefined ? this.moe(l, w.moe, m) : this.mlp({ gate: w.gate!, up: w.up!, down: w.down!, I: this.I }, m)
      x = x.map((xi, i) => xi + dn[i]!)
    }
    return matvec(this.head, rmsNorm(x, this.norm, this.eps), this.V)
  }

  private mlp (w: RefMlp, m: Vec): Vec {
    const gate = matvec(w.gate, m, w.I)
    const up = matvec(w.up, m, w.I)
    const act = gate.map((gv, i) => gv / (1 + Math.exp(-gv)) * up[i]!)
    return matvec(w.down, act, this.D)
  }

  /** Every MoE layer's choice for every token stepped so far (tests read it). */
  readonly routes: RefRoute[] = []

  /**
   * HF's sparse MoE block: softmax over the router logits, the top k (ties to the lower index),
   * renormalised when norm_topk_prob (always for Mixtral), weighted sum of the chosen experts,
   * plus Qwen2-MoE's sigmoid-gated shared expert.
   */
  private moe (l: number, w: RefMoe, m: Vec): Vec {
    const E = w.experts.length
    const k = this.cfg.num_experts_per_tok as number
    const logits = matvec(w.router, m, E)
    const mx = Math.max(...logits)
    const ex = logits.map(v => Math.exp(v - mx))
    const z = ex.reduce((a, b) => a + b, 0)
    const probs = ex.map(v => v / z)
    const chosen = Array.from({ length: E }, (_, e) => e).sort((a, b) => probs[b]! - probs[a]! || a - b).slice(0, k)
    const norm = this.cfg.model_type === 'mixtral' || this.cfg.norm_topk_prob === true
    const total = chosen.reduce((s, e) => s + probs[e]!, 0)
    const weights = chosen.map(e => norm ? probs[e]! / total : probs[e]!)
    this.routes.push({ layer: l, experts: chosen, weights })
    const out = new Float64Array(this.D)
    chosen.forEach((e, i) => {
      const y = this.mlp(w.experts[e]!, m)
      for (let d = 0; d < this.D; d++) out[d]! += weights[i]! * y[d]!
    })
    if (w.shared !== undefined) {
      const y = this.mlp(w.shared, m)
      const g = 1 / (1 + Math.exp(-matvec(w.shared.sgate, m, 1)[0]!))
      for (let d = 0; d < this.D; d++) out[d]! += g * y[d]!
    }
    return out
  }

  /** Greedy continuation of `prompt` for `n` tokens; also returns each step's top-2 logit margin. */
  greedy (prompt: number[], n: number): { tokens: number[], margins: number[], logits: Vec[] } {
    const cache = this.newCache()
    let logits: Vec = new Float64Array(0)
    for (const t of prompt) logits = this.step(t, cache)
    const tokens: number[] = []
    const margins: number[] = []
    const all: Vec[] = []
    for (let i = 0; i < n; i++) {
      const { best, margin } = top2(logits)
      tokens.push(best)
      margins.push(margin)
      all.push(logits)
      if (i + 1 < n) logits = this.step(best, cache)
    }
    return { tokens, margins, logits: all }
  }
}

export function top2 (logits: ArrayLike<number>): { best: number, margin: number } {
  let best = 0
  for (let i = 1; i < logits.length; i++) if (logits[i]! > logits[best]!) best = i
  let second = -Infinity
  for (let i = 0; i < logits.length; i++) if (i !== best && logits[i]! > second) second = logits[i]!
  return { best, margin: logits[best]! - second }
}
