/**
 * Capability gossip on the gossipsub topic `/shoal/caps/1`. A message carries the sender's node
 * certificate and its capability record, signed with its node key (certs/signed.ts scheme), so any
 * receiver — even one not yet connected to the sender — can check both against the CA. Records are
 * ordered by `seq` (strictly increasing per node run, seeded from the clock so a restart is newer).
 */
import { arr, asObject, decodeJson, encodeJson, malformed, nonNeg, optStr, str, uint } from './frame.ts'
import type { SignedDocument } from '../../../certs/signed.ts'

export const CAPS_TOPIC = '/shoal/caps/1'
export const CAPS_MAX_MESSAGE = 64 * 1024
export const CAPABILITY_RECORD_TYPE = 'shoal.capabilities'
export const CAPABILITY_RECORD_VERSION = 1

const MAX_MODELS = 64
const MAX_ADDRS = 16
const MAX_PROTOCOLS = 32

/** One model (or one stage of one) that a node serves. */
export interface ServedModel {
  /** Model id as served over the API. */
  id: string
  /** sha256 of the shard manifest, so a chain is only built from stages of one compilation. */
  manifestHash?: string
  /** Inclusive global layer range [first, last] when serving one stage; absent for a whole model. */
  layers?: [number, number]
  /** Layers of the whole model (to tell whether a set of stages covers it). */
  totalLayers?: number
  /** Context limit in tokens. */
  maxContextTokens?: number
  /**
   * The drafter speculative decoding uses for requests entering here (`draft:<model>` or
   * `prompt-lookup`); absent without one. Optional: older readers ignore it.
   */
  drafter?: string
  /**
   * Measured decode step time of this node's stage (ms per single-position step, a moving
   * average; absent until measured). Chain formation prefers faster holders by it. Optional:
   * older readers ignore it.
   */
  stepMs?: number
  /**
   * Lossy activation encodings this stage decodes on /shoal/stage (`f16`, `int8`); absent: f32
   * only. A coordinator opens a chain lossy only when every stage lists the encoding.
   */
  activations?: string[]
  /**
   * The devices this model runs on here (a local chain: one per stage, in stage order), as the
   * engine names them (`CPU`, `GPU`, `NPU`). Optional: older readers ignore it. Placement goes by
   * measured step times, not by these names; they say where the work runs.
   */
  devices?: string[]
  /**
   * shoal's own kernels this model's graphs run on here (`int4`: its int4 product in place of
   * onnxruntime's MatMulNBits; `attention`: its one-position attention; `verify`: a whole
   * model's speculative verify steps, position by position as one-position steps; daemon/engine/native).
   * Absent: onnxruntime's kernels only.
   * Replicas give a sequence the same tokens bit for bit only with the same kernels (otherwise to
   * float rounding, a near tie apart). Optional: older readers ignore it.
   */
  kernels?: string[]
}

/**
 * Experts of a mixture-of-experts model this node holds for stage nodes (daemon/experts): the
 * expert-parallel shards' key (sha256 of their layout.json, which names the checkpoint's hash),
 * and the memory it offers (what placement plans with; it loads the experts a stage sends it
 * rows for, up to that budget).
 */
export interface ExpertsCapability {
  /** Key the /shoal/experts frames carry. */
  model: string
  /** The served model's id. */
  modelId: string
  /** Bytes the holder keeps experts in (its --expert-memory-mb). */
  budgetBytes: number
}

/** What a node declares about itself (`mesh.setCapabilities`). */
export interface Capabilities {
  models: ServedModel[]
  /** e.g. 'onnxruntime', 'openvino', 'simulated'. */
  engine?: string
  /** e.g. 'cpu', 'gpu', 'npu'. */
  device?: string
  memory?: { totalBytes: number, freeBytes: number }
  /** Largest context any served model accepts on this node, in tokens. */
  maxContextTokens?: number
  /** The node's HTTP ingress (`http://host:port`) when it has one. */
  ingress?: string
  /** shoal's software version. */
  software?: string
  /** Expert holders only. Optional: older readers ignore it. */
  experts?: ExpertsCapability[]
}

export interface CapabilityRecordBody extends Capabilities {
  type: typeof CAPABILITY_RECORD_TYPE
  version: typeof CAPABILITY_RECORD_VERSION
  peerId: string
  name: string
  seq: number
  /** ms since the epoch when signed. */
  issuedAt: number
  /** libp2p multiaddrs (with /p2p/<peerId>) to reach the node. */
  addrs: string[]
  /** Every protocol id and topic the node speaks. */
  protocols: string[]
}

export type CapabilityRecord = SignedDocument<CapabilityRecordBody>

export interface CapsMessage {
  v: 1
  type: 'caps'
  certificate: unknown
  record: CapabilityRecord
}

export function encodeCapsMessage (certificate: unknown, record: CapabilityRecord): Uint8Array {
  return encodeJson({ v: 1, type: 'caps', certificate, record }, CAPS_MAX_MESSAGE)
}

/**
 * Decodes a gossip message. The record's body is returned as received (the signature covers
 * exactly it) after its fields are checked; the certificate is left for certs/ to judge.
 */
export function decodeCapsMessage (bytes: Uint8Array): CapsMessage {
  const obj = decodeJson(bytes, CAPS_MAX_MESSAGE)
  if (obj.type !== 'caps') throw malformed(`unknown caps message type ${JSON.stringify(obj.type.slice(0, 32))}`)
  asObject(obj.certificate, 'caps.certificate')
  const record = asObject(obj.record, 'caps.record')
  const signature = str(record.signature, 'record.signature', 128)
  const body = parseCapabilityBody(record.body)
  return { v: 1, type: 'caps', certificate: obj.certificate, record: { body, signature } }
}

function model (value: unknown, where: string): ServedModel {
  const obj = asObject(value, where)
  const out: ServedModel = { id: str(obj.id, `${where}.id`, 256) }
  const hash = optStr(obj.manifestHash, `${where}.manifestHash`, 128)
  if (hash !== undefined) out.manifestHash = hash
  if (obj.layers !== undefined) {
    const layers = arr(obj.layers, `${where}.layers`, 2)
    const first = uint(layers[0], `${where}.layers[0]`)
    const last = uint(layers[1], `${where}.layers[1]`)
    if (last < first) throw malformed(`${where}.layers is not [first, last]`)
    out.layers = [first, last]
  }
  if (obj.totalLayers !== undefined) out.totalLayers = uint(obj.totalLayers, `${where}.totalLayers`)
  if (obj.maxContextTokens !== undefined) out.maxContextTokens = uint(obj.maxContextTokens, `${where}.maxContextTokens`)
  const drafter = optStr(obj.drafter, `${where}.drafter`, 128)
  if (drafter !== undefined) out.drafter = drafter
  if (obj.stepMs !== undefined) out.stepMs = nonNeg(obj.stepMs, `${where}.stepMs`)
  if (obj.activations !== undefined) out.activations = arr(obj.activations, `${where}.activations`, 8).map((a, i) => str(a, `${where}.activations[${i}]`, 16))
  if (obj.devices !== undefined) out.devices = arr(obj.devices, `${where}.devices`, 16).map((d, i) => str(d, `${where}.devices[${i}]`, 32))
  if (obj.kernels !== undefined) out.kernels = arr(obj.kernels, `${where}.kernels`, 8).map((k, i) => str(k, `${where}.kernels[${i}]`, 32))
  return out
}

/** Strict check of a record body; returns it unchanged (the signed bytes must stay the same). */
export function parseCapabilityBody (value: unknown): CapabilityRecordBody {
  const body = asObject(value, 'record.body')
  if (body.type !== CAPABILITY_RECORD_TYPE) throw malformed('record.body.type is not shoal.capabilities')
  if (body.version !== CAPABILITY_RECORD_VERSION) throw malformed(`record.body.version ${String(body.version).slice(0, 16)} is not known`)
  str(body.peerId, 'record.body.peerId', 128)
  str(body.name, 'record.body.name', 64)
  uint(body.seq, 'record.body.seq')
  uint(body.issuedAt, 'record.body.issuedAt')
  arr(body.addrs, 'record.body.addrs', MAX_ADDRS).forEach((a, i) => str(a, `record.body.addrs[${i}]`, 256))
  arr(body.protocols, 'record.body.protocols', MAX_PROTOCOLS).forEach((p, i) => str(p, `record.body.protocols[${i}]`, 128))
  arr(body.models, 'record.body.models', MAX_MODELS).forEach((m, i) => model(m, `record.body.models[${i}]`))
  optStr(body.engine, 'record.body.engine', 64)
  optStr(body.device, 'record.body.device', 64)
  optStr(body.ingress, 'record.body.ingress', 256)
  optStr(body.software, 'record.body.software', 64)
  if (body.maxContextTokens !== undefined) uint(body.maxContextTokens, 'record.body.maxContextTokens')
  if (body.experts !== undefined) {
    arr(body.experts, 'record.body.experts', MAX_MODELS).forEach((e, i) => {
      const o = asObject(e, `record.body.experts[${i}]`)
      str(o.model, `record.body.experts[${i}].model`, 128)
      str(o.modelId, `record.body.experts[${i}].modelId`, 256)
      nonNeg(o.budgetBytes, `record.body.experts[${i}].budgetBytes`)
    })
  }
  if (body.memory !== undefined) {
    const memory = asObject(body.memory, 'record.body.memory')
    nonNeg(memory.totalBytes, 'record.body.memory.totalBytes')
    nonNeg(memory.freeBytes, 'record.body.memory.freeBytes')
  }
  return body as unknown as CapabilityRecordBody
}

/** A record body with only defined fields (JCS has no `undefined`). */
export function capabilityBody (fields: Omit<CapabilityRecordBody, 'type' | 'version'>): CapabilityRecordBody {
  const body: Record<string, unknown> = { type: CAPABILITY_RECORD_TYPE, version: CAPABILITY_RECORD_VERSION }
  for (const [key, value] of Object.entries(fields)) if (value !== undefined) body[key] = value
  return body as unknown as CapabilityRecordBody
}
