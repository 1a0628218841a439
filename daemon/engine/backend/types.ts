/**
 * The backend interface: the one seam between the engine and an inference runtime. A backend loads
 * a stage graph (model.onnx with external weights, by path) for a device and runs it with named
 * host tensors. Every implementation passes test/engine/backend-conformance.ts.
 */
import { join } from 'node:path'

export type HostTensor =
  | { type: 'float32', data: Float32Array, dims: number[] }
  | { type: 'int64', data: BigInt64Array, dims: number[] }

export type TensorMap = Record<string, HostTensor>

export interface LoadOptions {
  /** Backend device name: 'CPU' for onnxruntime; 'CPU' | 'GPU' | 'NPU' | 'AUTO' for OpenVINO. */
  device: string
  /** Intra-op threads; default: all cores. */
  threads?: number
  /**
   * True when this session has the cores to itself: its intra-op threads spin between runs too.
   * Otherwise they spin only while a run is in progress: two sessions whose threads spin between
   * runs slow each other by 4–9 ms per step (docs/engine-notes.md).
   */
  exclusiveCores?: boolean
  /**
   * The node's compiled-model cache directory (compiledCacheDir): a backend that compiles graphs
   * per device keeps its compiled blobs under its own subdirectory there, so a restart loads
   * without recompiling (OpenVINO: CACHE_DIR). Absent: nothing is cached.
   */
  cacheDir?: string
  /**
   * The path of shoal's kernel library (daemon/engine/native): onnxruntime graphs are loaded with
   * every MatMulNBits the kernel takes made its MatMulQ4, every one-position attention block its
   * DecodeAttention, and verify steps VerifyAttention (native/swap.ts). Absent: as compiled.
   */
  kernels?: string
}

/** The compiled-model cache under a node's cache root (OpenVINO blobs in its openvino/ subdirectory). */
export function compiledCacheDir (cacheRoot: string): string {
  return join(cacheRoot, 'compiled')
}

/** OpenVINO's CACHE_DIR inside a compiled-model cache directory. */
export function openvinoCacheDir (cacheDir: string): string {
  return join(cacheDir, 'openvino')
}

export interface BackendSession {
  readonly inputNames: readonly string[]
  readonly outputNames: readonly string[]
  /**
   * Its one-position steps attend over each row's live past columns only (shoal's attention
   * kernel, native/swap.ts): a past buffer's spare columns then cost memory, not time. Absent: they
   * may cost time (onnxruntime's attention reads the whole buffer).
   */
  readonly liveColumnsOnly?: boolean
  /**
   * Runs the graph; returns every output, or with `fetches` at least those (owned by the caller,
   * safe to keep across runs). Fetching fewer saves copying outputs nobody reads.
   */
  run (feeds: TensorMap, fetches?: readonly string[]): Promise<TensorMap>
  close (): Promise<void>
}

export interface Backend {
  readonly name: BackendName
  /** Devices this backend can load graphs on, here and now. */
  devices (): string[]
  load (graphPath: string, options: LoadOptions): Promise<BackendSession>
}

export type BackendName = 'onnxruntime' | 'openvino'

