// Types for scripts/toolchain.mjs (plain JS so that it parses on any Node >= 18).
export declare const ROOT: string
export declare const FETCHED_MAJOR: number
export declare const MINIMUM: [number, number]
export declare const MINIMUM_TEXT: string
export declare function parseMinimum (range: string | undefined): [number, number]
export declare function isNewEnough (version: string, minimum?: [number, number]): boolean
export declare function toolchainDir (): string
export declare function nodePackage (platform?: string, arch?: string): string
export declare function modernNode (): string
export declare function runWith (node: string, command: string | string[]): void
