/**
 * Reading and writing safetensors files: single files and index-sharded checkpoints
 * (model.safetensors.index.json). Every float dtype the importer accepts (F32, F16, BF16) is
 * widened to Float32Array on read, because the graphs compute in f32.
 */
import { open, readFile } from 'node:fs/promises'
import { existsSync } from 'node:fs'
import { join } from 'node:path'
import { CheckpointError } from './errors.ts'

export type SafetensorsDtype = 'F32' | 'F16' | 'BF16'

export interface TensorEntry {
  dtype: string
  shape: number[]
  /** Absolute file path and byte range of the data. */
  file: string
  begin: number
  end: number
}

export interface F32Tensor {
  shape: number[]
  data: Float32Array
}

/** Upper bound on the JSON header, so a corrupt file cannot make us allocate gigabytes. */
const MAX_HEADER_BYTES = 100 * 1024 * 1024

const DTYPE_BYTES: Record<string, number> = { F64: 8, F32: 4, F16: 2, BF16: 2, I64: 8, I32: 4, I16: 2, I8: 1, U8: 1, BOOL: 1 }
const isCount = (v: unknown): v is number => typeof v === 'number' && Number.isSafeInteger(v) && v >= 0

/** One header entry, well formed: a dtype, a shape, and a byte range inside the data that holds exactly that shape. */
function checkEntry (file: string, name: string, e: unknown, dataBytes: number): { dtype: string, shape: number[], offsets: [number, number] } {
  const bad = (what: string): CheckpointError => new CheckpointError(`${file}: tensor "${name.slice(0, 200)}": ${what}`)
  if (typeof e !== 'object' || e === null || Array.isArray(e)) throw bad('not an object')
  const { dtype, shape, data_offsets: offsets } = e as Record<string, unknown>
  if (typeof dtype !== 'string') throw bad('dtype is not a string')
  if (!Array.isArray(shape) || !shape.every(isCount)) throw bad('shape is not a list of sizes')
  if (!Array.isArray(offsets) || offsets.length !== 2 || !isCount(offsets[0]) || !isCount(offsets[1]) || offsets[1] < offsets[0]) throw bad('data_offsets is not [begin, end]')
  if (offsets[1] > dataBytes) throw bad(`data_offsets end ${offsets[1]} is past the file's ${dataBytes} data bytes`)
  const size = DTYPE_BYTES[dtype]
  const elements = shape.reduce((n: number, d: number) => n * d, 1)
  if (size !== undefined && elements * size !== offsets[1] - offsets[0]) throw bad(`${offsets[1] - offsets[0]} bytes for shape [${shape.join(', ')}] of ${dtype}`)
  return { dtype, shape: shape as number[], offsets: [offsets[0], offsets[1]] }
}

async function readHeader (file: string): Promise<Map<string, TensorEntry>> {
  const fh = await open(file, 'r')
  try {
    const lenBuf = Buffer.alloc(8)
    await fh.read(lenBuf, 0, 8, 0)
    const len = Number(lenBuf.readBigUInt64LE(0))
    if (len <= 0 || len > MAX_HEADER_BYTES) throw new CheckpointError(`${file}: bad safetensors header length ${len}`)
    const headerBuf = Buffer.alloc(len)
    await fh.read(headerBuf, 0, len, 8)
    const header = JSON.parse(headerBuf.toString('utf8')) as unknown
    if (typeof header !== 'object' || header === null || Array.isArray(header)) throw new CheckpointError(`${file}: the safetensors header is not a JSON object`)
    // Every range is checked against the file before anything is read: a corrupt or hostile header
    // must not make `get` allocate what its offsets claim.
    const dataBytes = (await fh.stat()).size - 8 - len
    const out = new Map<string, TensorEntry>()
    for (const [name, e] of Object.entries(header as Record<string, unknown>)) {
      if (name === '__metadata__') continue
      const entry = checkEntry(file, name, e, dataBytes)
      out.set(name, { ...entry, file, begin: 8 + len + entry.offsets[0], end: 8 + len + entry.offsets[1] })
    }
    return out
  } catch (err) {
    if (err instanceof CheckpointError) throw err
    throw new CheckpointError(`${file}: cannot read safetensors header: ${(err as Error).message}`, { cause: err })
  } finally {
    await fh.close()
  }
}

/** The safetensors files of a checkpoint directory: the index's shards, or model.safetensors. */
export async function checkpointWeightFiles (dir: string): Promise<string[]> {
  const index = join(dir, 'model.safetensors.index.json')
  if (existsSync(index)) {
    let parsed: unknown
    try {
      parsed = JSON.parse(await readFile(index, 'utf8'))
    } catch (err) {
      throw new CheckpointError(`${index}: not readable JSON`, { cause: err })
    }
    const map = (parsed as { weight_map?: unknown } | null)?.weight_map
    if (typeof map !== 'object' || map === null || Array.isArray(map)) throw new CheckpointError(`${index}: no weight_map`)
    const files = Object.values(map)
    if (!files.every((f): f is string => typeof f === 'string' && f !== '')) throw new CheckpointError(`${index}: weight_map names something other than a file`)
    return [...new Set(files)].sort().map(f => join(dir, f))
  }
  const single = join(dir, 'model.safetensors')
  if (existsSync(single)) return [single]
  throw new CheckpointError(`${dir}: no model.safetensors or model.safetensors.index.json`)
}

/** A lazy view of all tensors in a checkpoint; tensors are read (and widened to f32) on demand. */
export interface WeightStore {
  names: () => string[]
  has: (name: string) => boolean
  shapeOf: (name: string) => number[]
  get: (name: string) => Promise<F32Tensor>
}

export async function openWeights (dir: string): Promise<WeightStore> {
  const entries = new Map<string, TensorEntry>()
  for (const file of await checkpointWeightFiles(dir)) {
    for (const [k, v] of await readHeader(file)) entries.set(k, v)
  }
  const entry = (name: string): TensorEntry => {
    const e = entries.get(name)
    if (e === undefined) throw new CheckpointError(`${dir}: tensor "${name}" not found in checkpoint`)
    return e
  }
  return {
    names: () => [...entries.keys()],
    has: (name) => entries.has(name),
    shapeOf: (name) => entry(name).shape,
    get: async (name) => {
      const e = entry(name)
      const fh = await open(e.file, 'r')
      try {
        const buf = Buffer.alloc(e.end - e.begin)
        await fh.read(buf, 0, buf.length, e.begin)
        return { shape: e.shape, data: toF32(buf, e.dtype, `${name} in ${e.file}`) }
      } finally {
        await fh.close()
      }
    },
  }
}

const f32Scratch = new Float32Array(1)
const u32Scratch = new Uint32Array(f32Scratch.buffer)

export function bf16ToF32 (h: number): number {
  u32Scratch[0] = h << 16
  return f32Scratch[0]!
}

export function f16ToF32 (h: number): number {
  const s = (h & 0x8000) !== 0 ? -1 : 1
  const e = (h >> 10) & 0x1f
  const m = h & 0x3ff
  if (e === 0) return s * m * 2 ** -24
  if (e === 31) return m === 0 ? s * Infinity : NaN
  return s * (1 + m / 1024) * 2 ** (e - 15)
}

/** Round-to-nearest-even f32 → bf16 bits. */
export function f32ToBf16 (x: number): number {
  f32Scratch[0] = x
  const u = u32Scratch[0]!
  if ((u & 0x7f800000) === 0x7f800000 && (u & 0x7fffff) !== 0) return 0x7fc0
  return ((u + 0x7fff + ((u >>> 16) & 1)) >>> 16) & 0xffff
}

/** Round-to-nearest-even f32 → f16 bits (normal range; test weights never overflow). */
export function f32ToF16 (x: number): number {
  f32Scratch[0] = x
  const u = u32Scratch[0]!
  const sign = (u >>> 16) & 0x8000
  const exp = ((u >>> 23) & 0xff) - 127 + 15
  let mant = u & 0x7fffff
  if (exp >= 31) return sign | 0x7c00
  if (exp <= 0) {
    if (exp < -10) return sign
    mant = (mant | 0x800000) >> (1 - exp)
    return sign | ((mant + 0xfff + ((mant >> 13) & 1)) >> 13)
  }
  const r = (exp << 10) | (mant >> 13)
  const rest = mant & 0x1fff
  const round = rest > 0x1000 || (rest === 0x1000 && (r & 1) === 1) ? 1 : 0
  return sign | (r + round)
}

function toF32 (buf: Buffer, dtype: string, what: string): Float32Array {
  switch (dtype) {
    case 'F32': {
      // Little-endian hosts only (x86, arm64): a byte copy is the conversion.
      const out = new Float32Array(buf.length / 4)
      new Uint8Array(out.buffer).set(buf)
      return out
    }
    case 'F16':
    case 'BF16': {
      const out = new Float32Array(buf.length / 2)
      const conv = dtype === 'F16' ? f16ToF32 : bf16ToF32
      for (let i = 0; i < out.length; i++) out[i] = conv(buf.readUInt16LE(i * 2))
      return out
    }
    default:
      throw new CheckpointError(`${what}: unsupported dtype ${dtype} (supported: F32, F16, BF16)`)
  }
}

export interface TensorToWrite {
  name: string
  shape: number[]
  /** Produces the data when its turn comes, so a large checkpoint never sits in memory whole. */
  data: Float32Array | (() => Float32Array)
}

/** Streams tensors into one safetensors file (data in the given order, header padded to 8 bytes). */
export async function writeSafetensors (file: string, tensors: TensorToWrite[], dtype: SafetensorsDtype = 'F32', metadata: Record<string, string> = { format: 'pt' }): Promise<void> {
  const width = dtype === 'F32' ? 4 : 2
  const header: Record<string, unknown> = { __metadata__: metadata }
  let offset = 0
  for (const t of tensors) {
    const n = t.shape.reduce((a, b) => a * b, 1) * width
    header[t.name] = { dtype, shape: t.shape, data_offsets: [offset, offset + n] }
    offset += n
  }
  let json = JSON.stringify(header)
  while ((8 + Buffer.byteLength(json)) % 8 !== 0) json += ' '
  const headerBytes = Buffer.from(json, 'utf8')
  const fh = await open(file, 'w')
  try {
    const len = Buffer.alloc(8)
    len.writeBigUInt64LE(BigInt(headerBytes.length), 0)
    await fh.write(len)
    await fh.write(headerBytes)
    for (const t of tensors) {
      const data = typeof t.data === 'function' ? t.data() : t.data
      if (dtype === 'F32') {
        await fh.write(new Uint8Array(data.buffer, data.byteOffset, data.byteLength))
      } else {
        const out = new Uint16Array(data.length)
        const conv = dtype === 'F16' ? f32ToF16 : f32ToBf16
        for (let i = 0; i < data.length; i++) out[i] = conv(data[i]!)
        await fh.write(new Uint8Array(out.buffer))
      }
    }
  } finally {
    await fh.close()
  }
}
